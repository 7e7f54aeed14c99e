"""Top-k router with fp32 logits, softmax or sigmoid scores, optional renormalisation,
an expert bias for aux-loss-free balancing, group-limited selection (DeepSeek-V3), and
the auxiliary losses."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from hylora.model.init import ParamInit, logical, weight_std

from meshes import logical_axes as ax
from hylora.core import save_points
from hylora.core.config import MoEConfig
from hylora.core.errors import ConfigError
from meshes.per_shard import split_over_tokens


class RouterBias(nnx.Variable):
  """Per-expert bias added for selection only (aux-loss-free balancing); updated outside
  the optimizer, never differentiated."""


class Router(nnx.Module):

  def __init__(self, d: int, cfg: MoEConfig, *, init_std: float, init: ParamInit,
               dtype: str = "bfloat16"):
    self.cfg = cfg
    if cfg.groups > 1 and (cfg.experts % cfg.groups or not 1 <= cfg.groups_kept <= cfg.groups or
                           cfg.top_k > cfg.groups_kept * (cfg.experts // cfg.groups)):
      raise ConfigError(f"model.moe.groups: {cfg.experts} experts in {cfg.groups} groups, "
                        f"{cfg.groups_kept} kept, cannot give top_k={cfg.top_k} experts")
    w = init.normal((d, cfg.experts), weight_std(init_std, d), jnp.dtype(dtype))
    self.kernel = nnx.Param(w, **logical(ax.EMBED, None))
    self.bias = RouterBias(jnp.zeros((cfg.experts,), jnp.float32), **logical(None))

  def __call__(self, x: jax.Array, seq_len: int | None = None):
    """x [N, d] (N = sequences x seq_len) or [B, T, d] -> (weights [..., k] fp32, experts
    [..., k] int32, aux), with x's leading dimensions. A [B, T, d] input keeps its tokens
    where the activation rules placed them (a sequence split over devices included)."""
    cfg = self.cfg
    logits = jnp.dot(x.astype(jnp.float32), self.kernel[...].astype(jnp.float32))
    logits = save_points.tag(logits, save_points.ROUTER)
    if cfg.score_fn == "softmax":
      scores = jax.nn.softmax(logits, axis=-1)
    else:
      scores = jax.nn.sigmoid(logits)
    selection = scores + jax.lax.stop_gradient(self.bias[...])
    experts = _top_k_experts(selection, cfg.top_k, seq_len, cfg.groups, cfg.groups_kept)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.normalize_top_k:
      weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * cfg.routed_scale

    n = math.prod(x.shape[:-1])
    load = jnp.zeros((cfg.experts,), jnp.float32).at[experts.reshape(-1)].add(1.0)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    if cfg.aux_loss_kind == "sequence":
      aux_loss = sequence_balance_loss(experts.reshape(n, -1), probs.reshape(n, -1), cfg.experts,
                                       x.shape[1] if x.ndim == 3 else (seq_len or n))
    else:
      # Switch-style balance loss: E * sum_e (fraction of routed pairs to e) * (mean prob of e).
      mean_probs = jnp.mean(probs.reshape(n, -1), axis=0)
      aux_loss = cfg.experts * jnp.sum((load / (n * cfg.top_k)) * mean_probs)
    z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return weights, experts.astype(jnp.int32), {
        "moe_aux_loss": aux_loss,
        "moe_z_loss": z_loss,
        "expert_load": load
    }


def keep_best_groups(selection: jax.Array, groups: int, kept: int) -> jax.Array:
  """[..., E] selection scores with every expert outside the token's `kept` best groups
  set to -inf; a group (E / groups consecutive experts) scores the sum of its two best."""
  *lead, e = selection.shape
  per_group = selection.reshape(*lead, groups, e // groups)
  group_scores = jnp.sum(jax.lax.top_k(per_group, min(2, e // groups))[0], axis=-1)
  best = jax.lax.top_k(group_scores, kept)[1]  # [..., kept]
  keep = jnp.any(best[..., :, None] == jnp.arange(groups), axis=-2)  # [..., groups]
  return jnp.where(keep[..., None], per_group, -jnp.inf).reshape(selection.shape)


def _top_k_experts(selection: jax.Array, k: int, seq_len: int | None, groups: int = 1,
                   groups_kept: int = 1) -> jax.Array:
  """The k largest of each token's [N, E] selection scores (within its `groups_kept` best
  groups when `groups` > 1), per device on its own tokens. Left to the partitioner,
  XLA:CPU (the dry run's compiler) gathers the whole batch's scores onto every device for
  its TopK (f32 [2M, 896], 7.5 GB at the 2p8t plan) where XLA:GPU keeps them local;
  explicit, both compile the same program."""

  def pick(s):
    if groups > 1:
      s = keep_best_groups(s, groups, groups_kept)
    return jax.lax.top_k(s, k)[1]

  if selection.ndim == 3:  # [B, T, E]
    return split_over_tokens(pick)(selection)
  n, e = selection.shape
  if seq_len is None or n % seq_len:
    return pick(selection)
  rows = selection.reshape(n // seq_len, seq_len, e)  # [B, T, E], as the tokens were laid out
  experts = split_over_tokens(pick)(rows)
  return experts.reshape(n, k)


def sequence_balance_loss(experts: jax.Array, probs: jax.Array, num_experts: int,
                          seq_len: int) -> jax.Array:
  """The balance loss within each sequence, averaged over sequences (DeepSeek-V3's
  sequence-wise loss): one skewed sequence is penalised even if the batch is balanced."""
  n, k = experts.shape
  seqs = n // seq_len
  rows = jnp.repeat(jnp.arange(seqs), seq_len * k)
  load = jnp.zeros((seqs, num_experts), jnp.float32).at[rows, experts.reshape(-1)].add(1.0)
  mean_probs = probs.reshape(seqs, seq_len, num_experts).mean(axis=1)
  per_seq = num_experts * jnp.sum(load / (seq_len * k) * mean_probs, axis=-1)
  return jnp.mean(per_seq)

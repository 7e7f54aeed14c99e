"""Top-k router with fp32 logits, softmax or sigmoid scores, optional renormalisation,
an expert bias for aux-loss-free balancing, and the auxiliary losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hylora.model.init import ParamInit, logical, weight_std

from meshes import logical_axes as ax
from hylora.core import save_points
from hylora.core.config import MoEConfig
from meshes.per_shard import split_over_tokens


class RouterBias(nnx.Variable):
  """Per-expert bias added for selection only (aux-loss-free balancing); updated outside
  the optimizer, never differentiated."""


class Router(nnx.Module):

  def __init__(self, d: int, cfg: MoEConfig, *, init_std: float, init: ParamInit,
               dtype: str = "bfloat16"):
    self.cfg = cfg
    w = init.normal((d, cfg.experts), weight_std(init_std, d), jnp.dtype(dtype))
    self.kernel = nnx.Param(w, **logical(ax.EMBED, None))
    self.bias = RouterBias(jnp.zeros((cfg.experts,), jnp.float32), **logical(None))

  def __call__(self, x: jax.Array, seq_len: int | None = None):
    """x [N, d] (N = sequences x seq_len) -> (weights [N, k] fp32, experts [N, k] int32, aux)."""
    cfg = self.cfg
    logits = jnp.dot(x.astype(jnp.float32), self.kernel[...].astype(jnp.float32))
    logits = save_points.tag(logits, save_points.ROUTER)
    if cfg.score_fn == "softmax":
      scores = jax.nn.softmax(logits, axis=-1)
    else:
      scores = jax.nn.sigmoid(logits)
    selection = scores + jax.lax.stop_gradient(self.bias[...])
    experts = _top_k_experts(selection, cfg.top_k, seq_len)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.normalize_top_k:
      weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * cfg.routed_scale

    n = x.shape[0]
    load = jnp.zeros((cfg.experts,), jnp.float32).at[experts.reshape(-1)].add(1.0)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    if cfg.aux_loss_kind == "sequence":
      aux_loss = sequence_balance_loss(experts, probs, cfg.experts, seq_len or n)
    else:
      # Switch-style balance loss: E * sum_e (fraction of routed pairs to e) * (mean prob of e).
      aux_loss = cfg.experts * jnp.sum((load / (n * cfg.top_k)) * jnp.mean(probs, axis=0))
    z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return weights, experts.astype(jnp.int32), {
        "moe_aux_loss": aux_loss,
        "moe_z_loss": z_loss,
        "expert_load": load
    }


def _top_k_experts(selection: jax.Array, k: int, seq_len: int | None) -> jax.Array:
  """The k largest of each token's [N, E] selection scores, per device on its own tokens.
  Left to the partitioner, XLA:CPU (the dry run's compiler) gathers the whole batch's
  scores onto every device for its TopK (f32 [2M, 896], 7.5 GB at the 2p8t plan) where
  XLA:GPU keeps them local; explicit, both compile the same program."""
  n, e = selection.shape
  if seq_len is None or n % seq_len:
    return jax.lax.top_k(selection, k)[1]
  rows = selection.reshape(n // seq_len, seq_len, e)  # [B, T, E], as the tokens were laid out
  experts = split_over_tokens(lambda s: jax.lax.top_k(s, k)[1])(rows)
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

"""Multi-head latent attention (DeepSeek's MLA) in the forms Kimi Linear, DeepSeek-V3.2
and Kimi K3 release it.

Queries come from one q_proj, or through a latent: q_a_proj -> RMSNorm -> q_b_proj; each
query head is [nope_dim | rope_dim]. Keys and values come from one latent:
kv_a_proj_with_mqa gives [kv_rank | rope_dim]; the kv_rank part is RMS-normed and
kv_b_proj expands it per head into [key nope_dim | value v_dim]; the rope_dim part is one
key slice shared by every head. RoPE (interleaved pairs, plain or YaRN frequencies) turns
the rope parts of queries and shared key; without it (Kimi) they stay as they are.
Softmax scale (nope_dim + rope_dim)^-0.5, times YaRN's mscale^2 where it applies.
Attention is causal within each packed document, over every key, or over the keys
DeepSeek-V3.2's indexer picks (dsa_indexer.py). On a sequence split over devices, full
attention gathers the latent instead of K/V (latent_attention_split.py). K3 gates the
attention output with sigmoid(g_proj x) before o_proj. Parameter names follow the
checkpoints.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hylora.model.init import ParamInit, logical

from meshes import logical_axes as ax
from hylora import ops
from hylora.core import save_points
from hylora.core.config import LoRAConfig, MLAConfig, ModelConfig
from hylora.model.context import ForwardContext
from hylora.model.lora import Linear
from hylora.model.mixers.dsa_indexer import DSAIndexer
from hylora.model.mixers.latent_attention_split import split_sequence_latent_attention
from hylora.model.norms import rms_norm
from hylora.model.rope import YaRN, apply_rope_interleaved, rope_frequencies, yarn_mscale
from meshes.per_shard import sequence_split
from meshes.rules import constrain

_HEADS = (ax.BATCH, ax.SEQ, ax.HEADS, ax.HEAD_DIM)
# The latent RMSNorms' eps is fixed in the published MLA (DeepSeek and Kimi alike), not the
# model's norm eps (Kimi Linear's is 1e-5).
_LATENT_NORM_EPS = 1e-6


def _yarn(c: MLAConfig) -> YaRN | None:
  if c.yarn_factor <= 1:
    return None
  return YaRN(c.yarn_factor, c.yarn_original_max_positions, c.yarn_beta_fast, c.yarn_beta_slow,
              c.yarn_mscale, c.yarn_mscale_all_dim)


def softmax_scale(c: MLAConfig) -> float:
  """(nope_dim + rope_dim)^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 where YaRN
  is on and mscale_all_dim is set (DeepSeek)."""
  scale = (c.nope_dim + c.rope_dim)**-0.5
  yarn = _yarn(c) if c.rope else None
  if yarn is not None and yarn.mscale_all_dim:
    scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim)**2
  return scale


def _pad_last(x: jax.Array, width: int) -> jax.Array:
  return jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, width - x.shape[-1]),))


def _sparse_attention(ctx: ForwardContext, q, k, v, indices, scale):
  """Attention over the selected keys, with value head dim free.

  The sparse-attention op wants v shaped as k: the narrower side is zero-padded, which is
  exact (zero value columns give zero output columns, sliced off; zero query/key columns
  add nothing to a dot product).
  """
  d = max(q.shape[-1], v.shape[-1])
  q, k, v_padded = (_pad_last(t, d) for t in (q, k, v))
  attend = ops.resolve("sparse_attention.attend", ctx.execution.kernels)
  return attend(q, k, v_padded, indices, scale=scale)[..., :v.shape[-1]]


class LatentAttention(nnx.Module):

  def __init__(self, m: ModelConfig, lora: LoRAConfig | None, *, init: ParamInit):
    c = m.mla
    self.cfg = c
    d, h, qk = m.d_model, c.heads, c.nope_dim + c.rope_dim

    def proj(name, in_shape, out_shape, in_axes, out_axes, lora=lora):
      return Linear(in_shape, out_shape, in_axes, out_axes, name=name, lora=lora, init=init,
                    init_std=m.init_std, dtype=m.weight_dtype)

    if c.q_rank > 0:
      self.q_proj = None
      self.q_a_proj = proj("q_a_proj", (d,), (c.q_rank,), (ax.EMBED,), (ax.LOW_RANK,))
      self.q_a_layernorm = nnx.Param(jnp.ones((c.q_rank,), jnp.float32), **logical(None))
      self.q_b_proj = proj("q_b_proj", (c.q_rank,), (h, qk), (ax.LOW_RANK,),
                           (ax.HEADS, ax.HEAD_DIM))
    else:
      self.q_proj = proj("q_proj", (d,), (h, qk), (ax.EMBED,), (ax.HEADS, ax.HEAD_DIM))
      self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
    self.kv_a_proj_with_mqa = proj("kv_a_proj_with_mqa", (d,), (c.kv_rank + c.rope_dim,),
                                   (ax.EMBED,), (ax.LOW_RANK,))
    self.kv_a_layernorm = nnx.Param(jnp.ones((c.kv_rank,), jnp.float32), **logical(None))
    self.kv_b_proj = proj("kv_b_proj", (c.kv_rank,), (h, c.nope_dim + c.v_dim), (ax.LOW_RANK,),
                          (ax.HEADS, ax.HEAD_DIM))
    self.o_proj = proj("o_proj", (h, c.v_dim), (d,), (ax.HEADS, ax.HEAD_DIM), (ax.EMBED,))
    # The output gate and the indexer are frozen (no adapters).
    self.g_proj = (proj("g_proj", (d,), (h, c.v_dim), (ax.EMBED,),
                        (ax.HEADS, ax.HEAD_DIM), None) if c.output_gate else None)
    self.indexer = DSAIndexer(m, init=init) if c.index_topk > 0 else None
    # RoPE as static Python numbers: (inverse frequencies [rope_dim / 2], attention factor),
    # or None (NoPE).
    self.rope = None
    if c.rope:
      inv_freq, attention_factor = rope_frequencies(c.rope_dim, c.rope_theta, _yarn(c))
      self.rope = (tuple(float(f) for f in inv_freq), attention_factor)

  def __call__(self, x: jax.Array, ctx: ForwardContext):
    c, key = self.cfg, ctx.dropout_key
    if self.q_proj is not None:
      q_latent, q = None, self.q_proj(x, key)
    else:
      q_latent = rms_norm(self.q_a_proj(x, key), self.q_a_layernorm[...], _LATENT_NORM_EPS)
      q = self.q_b_proj(q_latent, key)
    q = save_points.tag(q, save_points.QKV)  # [B, T, H, nope + rope]
    latent = self.kv_a_proj_with_mqa(x, key)
    kv_latent, k_shared = latent[..., :c.kv_rank], latent[..., c.kv_rank:]
    kv_latent = rms_norm(kv_latent, self.kv_a_layernorm[...], _LATENT_NORM_EPS)
    if self.indexer is None and sequence_split(x) is not None:
      o = self._attend_split_sequence(q, kv_latent, k_shared, ctx)
    else:
      o = self._attend(x, q, q_latent, kv_latent, k_shared, ctx)
    o = save_points.tag(constrain(o, _HEADS), save_points.ATTENTION)  # [B, T, H, v]
    if self.g_proj is not None:
      gate = save_points.tag(jax.nn.sigmoid(self.g_proj(x).astype(jnp.float32)), save_points.GATES)
      o = (o.astype(jnp.float32) * gate).astype(x.dtype)
    return save_points.tag(self.o_proj(o, key), save_points.MIXER_OUT), {}

  def _rotate(self, q, k_shared, positions):
    """q [B, T, H, nope + rope] and the shared key [B, T, 1, rope] with RoPE on their rope
    parts (as they are without it), from q and k_shared [B, T, rope]."""
    c = self.cfg
    q_nope, q_rope = q[..., :c.nope_dim], q[..., c.nope_dim:]
    k_shared = k_shared[:, :, None, :]
    if self.rope is not None:
      inv_freq, attention_factor = self.rope
      q_rope = apply_rope_interleaved(q_rope, positions, inv_freq, attention_factor)
      k_shared = apply_rope_interleaved(k_shared, positions, inv_freq, attention_factor)
    return jnp.concatenate([q_nope, q_rope], axis=-1), k_shared

  def _attend_split_sequence(self, q, kv_latent, k_shared, ctx: ForwardContext):
    """Attention on a sequence split over devices: the latent is gathered, not K/V
    (latent_attention_split.py)."""
    c = self.cfg
    q, k_shared = self._rotate(q, k_shared, ctx.positions)
    return split_sequence_latent_attention(self.kv_b_proj, constrain(q, _HEADS), kv_latent,
                                           k_shared[:, :, 0], ctx.segment_ids, ctx.dropout_key,
                                           nope_dim=c.nope_dim, scale=softmax_scale(c),
                                           block_k=c.block_k)

  def _attend(self, x, q, q_latent, kv_latent, k_shared, ctx: ForwardContext):
    """Attention with the sequence whole on each device: K/V expanded for every token."""
    c = self.cfg
    kv = self.kv_b_proj(kv_latent, ctx.dropout_key)
    kv = save_points.tag(kv, save_points.QKV)  # [B, T, H, nope + v]
    k_nope, v = kv[..., :c.nope_dim], kv[..., c.nope_dim:]
    q, k_shared = self._rotate(q, k_shared, ctx.positions)
    k = jnp.concatenate(
        [k_nope, jnp.broadcast_to(k_shared, (*k_nope.shape[:3], c.rope_dim))], axis=-1)
    q, k, v = (constrain(t, _HEADS) for t in (q, k, v))
    scale = softmax_scale(c)

    if self.indexer is not None:
      indices = self.indexer(x, q_latent, ctx, rope=self.rope)
      o = _sparse_attention(ctx, q, k, v, indices, scale)
    else:
      attend = ops.resolve("attention.causal", ctx.execution.kernels)
      o = attend(q, k, v, segment_ids=ctx.segment_ids, scale=scale, block_q=c.block_q)
    return o

"""DeepSeek-V3.2's sparse-attention indexer: which keys each query of a latent-attention
layer attends to.

    score[t, s] = sum_h w[t, h] * relu(scale * q[t, h] . k[s]),   s <= t, same document

with q = wq_b(q_latent) [index_heads, index_head_dim], k = LayerNorm(wk x) (one head),
half-split RoPE on the first rope_dim dimensions of both, w = weights_proj(x) *
index_heads^-0.5 and scale = index_head_dim^-0.5. Each query keeps its index_topk best
keys (all of its keys when it has fewer). Frozen: no adapters, and no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hylora.model.init import ParamInit, logical

from meshes import logical_axes as ax
from hylora import ops
from hylora.core import save_points
from hylora.core.config import ModelConfig
from hylora.core.errors import ConfigError
from hylora.model.context import ForwardContext
from hylora.model.lora import Linear
from hylora.model.rope import apply_rope

_K_NORM_EPS = 1e-6  # fixed in the published indexer, whatever the model's norm eps


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
  """LayerNorm over the last axis with a bias, fp32 math, x's dtype out."""
  xf = x.astype(jnp.float32)
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
  y = (xf - mean) * jax.lax.rsqrt(var + eps)
  return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


class DSAIndexer(nnx.Module):

  def __init__(self, m: ModelConfig, *, init: ParamInit):
    c = m.mla
    if c.q_rank <= 0:
      raise ConfigError(f"model.mla.q_rank must be > 0 for the sparse-attention indexer "
                        f"(model.mla.index_topk = {c.index_topk} reads the query latent), "
                        f"got {c.q_rank}")
    self.cfg = c
    d, heads, hd = m.d_model, c.index_heads, c.index_head_dim

    def proj(name, in_shape, out_shape, in_axes, out_axes):
      return Linear(in_shape, out_shape, in_axes, out_axes, name=name, lora=None, init=init,
                    init_std=m.init_std, dtype=m.weight_dtype)

    self.wq_b = proj("wq_b", (c.q_rank,), (heads, hd), (ax.LOW_RANK,),
                     (ax.INDEX_HEADS, ax.HEAD_DIM))
    self.wk = proj("wk", (d,), (hd,), (ax.EMBED,), (ax.HEAD_DIM,))
    self.k_norm_scale = nnx.Param(jnp.ones((hd,), jnp.float32), **logical(None))
    self.k_norm_bias = nnx.Param(jnp.zeros((hd,), jnp.float32), **logical(None))
    self.weights_proj = proj("weights_proj", (d,), (heads,), (ax.EMBED,), (ax.INDEX_HEADS,))

  def __call__(self, x: jax.Array, q_latent: jax.Array, ctx: ForwardContext, *, rope=None):
    """int32 [B, T, index_topk] key positions per query (-1: unused).

    rope: (inv_freq, attention_factor) of the layer's RoPE, or None (no position).
    """
    c = self.cfg
    # The selection is not differentiated: stopping the gradient at the inputs keeps
    # autodiff away from the indexer's projections and its kernel.
    x, q_latent = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent)
    q = self.wq_b(q_latent)  # [B, T, HI, DI]
    k = layer_norm(self.wk(x), self.k_norm_scale[...], self.k_norm_bias[...], _K_NORM_EPS)
    if rope is not None:
      inv_freq, attention_factor = rope
      r = 2 * len(inv_freq)
      rotate = lambda t: apply_rope(t, ctx.positions, inv_freq=inv_freq, attention_factor=
                                    attention_factor)
      q = jnp.concatenate([rotate(q[..., :r]), q[..., r:]], axis=-1)
      k = jnp.concatenate([rotate(k[:, :, None, :r])[:, :, 0], k[..., r:]], axis=-1)
    # relu(scale * s) = scale * relu(s) for the positive scale: folded into the weights
    w = self.weights_proj(x).astype(jnp.float32) * (c.index_heads**-0.5 * c.index_head_dim**-0.5)
    q, k, w = (save_points.tag(t, save_points.INDEXER) for t in (q, k, w))
    topk = ops.resolve("sparse_attention.topk_indices", ctx.execution.kernels)
    return save_points.tag(topk(q, k, w, top_k=c.index_topk, segment_ids=ctx.segment_ids),
                           save_points.TOPK)

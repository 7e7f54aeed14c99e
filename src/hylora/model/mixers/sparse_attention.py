"""Top-K sparse attention: a light indexer picks `top_k` keys per query, then GQA
softmax attention runs over the selected keys only (RoPE on queries and keys)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hylora.model.init import ParamInit

from meshes import logical_axes as ax
from hylora import ops
from hylora.core import save_points
from hylora.core.config import LoRAConfig, ModelConfig
from hylora.model.context import ForwardContext
from hylora.model.lora import Linear
from hylora.model.rope import apply_rope
from meshes.rules import constrain


class SparseAttention(nnx.Module):

  def __init__(self, m: ModelConfig, lora: LoRAConfig | None, *, init: ParamInit):
    sa = m.sparse_attention
    self.cfg = sa
    d, std = m.d_model, m.init_std

    def proj(name, in_shape, out_shape, in_axes, out_axes, lora=lora):
      return Linear(in_shape, out_shape, in_axes, out_axes, name=name, lora=lora, init=init,
                    init_std=std, dtype=m.weight_dtype)

    hd = sa.head_dim
    self.q = proj("q", (d,), (sa.q_heads, hd), (ax.EMBED,), (ax.HEADS, ax.HEAD_DIM))
    self.k = proj("k", (d,), (sa.kv_heads, hd), (ax.EMBED,), (ax.KV_HEADS, ax.HEAD_DIM))
    self.v = proj("v", (d,), (sa.kv_heads, hd), (ax.EMBED,), (ax.KV_HEADS, ax.HEAD_DIM))
    self.o = proj("o", (sa.q_heads, hd), (d,), (ax.HEADS, ax.HEAD_DIM), (ax.EMBED,))
    # The indexer is frozen (not a LoRA target).
    self.index_q_down = proj("index_q_down", (d,), (sa.index_q_rank,), (ax.EMBED,), (ax.LOW_RANK,),
                             None)
    self.index_q_up = proj("index_q_up", (sa.index_q_rank,), (sa.index_heads, sa.index_head_dim),
                           (ax.LOW_RANK,), (ax.INDEX_HEADS, ax.HEAD_DIM), None)
    self.index_k = proj("index_k", (d,), (sa.index_head_dim,), (ax.EMBED,), (ax.HEAD_DIM,), None)
    self.index_w = proj("index_w", (d,), (sa.index_heads,), (ax.EMBED,), (ax.INDEX_HEADS,), None)

  def __call__(self, x: jax.Array, ctx: ForwardContext):
    sa, key, pos = self.cfg, ctx.dropout_key, ctx.positions
    q = apply_rope(save_points.tag(self.q(x, key), save_points.QKV), pos, sa.rope_theta)
    k = apply_rope(save_points.tag(self.k(x, key), save_points.QKV), pos, sa.rope_theta)
    v = save_points.tag(self.v(x, key), save_points.QKV)
    q = constrain(q, (ax.BATCH, ax.SEQ, ax.HEADS, ax.HEAD_DIM))
    k, v = (constrain(t, (ax.BATCH, ax.SEQ, ax.KV_HEADS, ax.HEAD_DIM)) for t in (k, v))

    q_idx = apply_rope(self.index_q_up(self.index_q_down(x)), pos, sa.rope_theta)
    k_idx = apply_rope(self.index_k(x)[:, :, None, :], pos, sa.rope_theta)[:, :, 0, :]
    w = self.index_w(x).astype(jnp.float32) * (sa.index_heads**-0.5)
    q_idx, k_idx, w = (save_points.tag(t, save_points.INDEXER) for t in (q_idx, k_idx, w))
    topk = ops.resolve("sparse_attention.topk_indices", ctx.execution.kernels)
    # The selection carries no gradient: stop it at the inputs, so autodiff never
    # linearises the indexer kernel.
    q_sel, k_sel, w_sel = (jax.lax.stop_gradient(t) for t in (q_idx, k_idx, w))
    indices = save_points.tag(
        topk(q_sel, k_sel, w_sel, top_k=sa.top_k, segment_ids=ctx.segment_ids), save_points.TOPK)

    attend = ops.resolve("sparse_attention.attend", ctx.execution.kernels)
    o = save_points.tag(attend(q, k, v, indices), save_points.ATTENTION)
    aux = {}
    if sa.indexer_loss_weight > 0:
      from pallas_kernels.sparse_attention import indexer_kl_loss
      aux["indexer_kl"] = indexer_kl_loss(q, k, q_idx, k_idx, w, indices)
    return save_points.tag(self.o(o, key), save_points.MIXER_OUT), aux

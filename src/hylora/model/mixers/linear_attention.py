"""Chunked linear attention (GLA / KDA family) with a per-channel decay gate, an optional
delta rule, a sigmoid output gate and a per-head RMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hylora.model.init import ParamInit, logical

from meshes import logical_axes as ax
from hylora import ops
from hylora.core import save_points
from hylora.core.config import LoRAConfig, ModelConfig
from hylora.model.context import ForwardContext
from hylora.model.lora import Linear
from hylora.model.norms import rms_norm
from meshes.rules import constrain


class LinearAttention(nnx.Module):

  def __init__(self, m: ModelConfig, lora: LoRAConfig | None, *, init: ParamInit):
    la = m.linear_attention
    self.cfg = la
    d, h, hd = m.d_model, la.heads, la.head_dim
    std = m.init_std

    def proj(name, in_shape, out_shape, in_axes, out_axes, lora=lora):
      return Linear(in_shape, out_shape, in_axes, out_axes, name=name, lora=lora, init=init,
                    init_std=std, dtype=m.weight_dtype)

    self.q = proj("q", (d,), (h, hd), (ax.EMBED,), (ax.HEADS, ax.HEAD_DIM))
    self.k = proj("k", (d,), (h, hd), (ax.EMBED,), (ax.HEADS, ax.HEAD_DIM))
    self.v = proj("v", (d,), (h, hd), (ax.EMBED,), (ax.HEADS, ax.HEAD_DIM))
    self.o = proj("o", (h, hd), (d,), (ax.HEADS, ax.HEAD_DIM), (ax.EMBED,))
    # Low-rank gates: frozen (not LoRA targets).
    self.decay_down = proj("decay_down", (d,), (la.gate_rank,), (ax.EMBED,), (ax.LOW_RANK,), None)
    self.decay_up = proj("decay_up", (la.gate_rank,), (h, hd), (ax.LOW_RANK,),
                         (ax.HEADS, ax.HEAD_DIM), None)
    self.out_gate_down = proj("out_gate_down", (d,), (la.output_gate_rank,), (ax.EMBED,),
                              (ax.LOW_RANK,), None)
    self.out_gate_up = proj("out_gate_up", (la.output_gate_rank,), (h, hd), (ax.LOW_RANK,),
                            (ax.HEADS, ax.HEAD_DIM), None)
    self.beta = (proj("beta", (d,), (h,), (ax.EMBED,),
                      (ax.HEADS,), None) if la.delta_rule else None)
    self.head_norm = nnx.Param(jnp.ones((hd,), jnp.float32), **logical(ax.HEAD_DIM))
    self.norm_eps = m.norm_eps

  def __call__(self, x: jax.Array, ctx: ForwardContext) -> jax.Array:
    key = ctx.dropout_key
    q = save_points.tag(self.q(x, key), save_points.QKV)
    k = save_points.tag(self.k(x, key), save_points.QKV)
    v = save_points.tag(self.v(x, key), save_points.QKV)
    decay_logits = self.decay_up(self.decay_down(x)).astype(jnp.float32)
    g = jnp.maximum(jax.nn.log_sigmoid(decay_logits), self.cfg.gate_floor)
    g = save_points.tag(g, save_points.GATES)
    names = (ax.BATCH, ax.SEQ, ax.HEADS, ax.HEAD_DIM)
    q, k, v, g = (constrain(t, names) for t in (q, k, v, g))
    if self.beta is not None:
      beta = save_points.tag(jax.nn.sigmoid(self.beta(x).astype(jnp.float32)), save_points.GATES)
      kda = ops.resolve("linear_attention.kda", ctx.execution.kernels)
      o, _ = kda(q, k, v, g, beta, segment_ids=ctx.segment_ids)
    else:
      gla = ops.resolve("linear_attention.gla", ctx.execution.kernels)
      o, _ = gla(q, k, v, g, segment_ids=ctx.segment_ids)
    o = save_points.tag(o, save_points.ATTENTION)
    out_gate = save_points.tag(
        jax.nn.sigmoid(self.out_gate_up(self.out_gate_down(x)).astype(jnp.float32)),
        save_points.GATES)
    o = (rms_norm(o, self.head_norm[...], self.norm_eps).astype(jnp.float32) * out_gate)
    return save_points.tag(self.o(o.astype(x.dtype), key), save_points.MIXER_OUT), {}

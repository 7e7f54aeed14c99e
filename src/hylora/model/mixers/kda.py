"""Kimi Delta Attention as the released Kimi Linear and Kimi K3 checkpoints define it.

q, k and v each pass a short causal depthwise convolution and SiLU (the registered op
"short_conv", which also L2-normalises q and k); a per-channel decay
g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias) (K3 with a lower bound L < 0:
g = L * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias))) and beta = sigmoid(b_proj x) drive
the gated delta rule (q, k L2-normalised, scale head_dim^-0.5; the op computes g from
f_b(f_a(x)) in its in-chunk cumulative sum, DecayGate); the result is RMS-normed
per head in fp32 and gated by sigmoid(g_b(g_a(x))) (K3: one full-rank g_proj) before
o_proj. Parameter names follow the checkpoints.
"""

from __future__ import annotations

import math

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
from pallas_kernels.linear_attention.decay_gate import A_RANGE, DT_RANGE, DecayGate, dt_bias_for


def _uniform(init: ParamInit, shape, low: float, high: float) -> jax.Array:
  """uniform(low, high) from the counter-based normal draws (through the normal CDF)."""
  return low + (high - low) * jax.scipy.special.ndtr(init.normal(shape))


class KimiDeltaAttention(nnx.Module):

  def __init__(self, m: ModelConfig, lora: LoRAConfig | None, *, init: ParamInit):
    c = m.kda
    self.cfg = c
    d, h, hd = m.d_model, c.heads, c.head_dim
    self.norm_eps = m.norm_eps

    def proj(name, in_shape, out_shape, in_axes, out_axes, lora=lora):
      return Linear(in_shape, out_shape, in_axes, out_axes, name=name, lora=lora, init=init,
                    init_std=m.init_std, dtype=m.weight_dtype)

    def conv():
      w = init.normal((h, hd, c.conv_size), c.conv_size**-0.5, jnp.dtype(m.weight_dtype))
      return nnx.Param(w, **logical(ax.HEADS, ax.HEAD_DIM, None))

    self.q_proj = proj("q_proj", (d,), (h, hd), (ax.EMBED,), (ax.HEADS, ax.HEAD_DIM))
    self.k_proj = proj("k_proj", (d,), (h, hd), (ax.EMBED,), (ax.HEADS, ax.HEAD_DIM))
    self.v_proj = proj("v_proj", (d,), (h, hd), (ax.EMBED,), (ax.HEADS, ax.HEAD_DIM))
    self.o_proj = proj("o_proj", (h, hd), (d,), (ax.HEADS, ax.HEAD_DIM), (ax.EMBED,))
    self.q_conv, self.k_conv, self.v_conv = conv(), conv(), conv()
    # Decay, beta and output gates are frozen (not LoRA targets).
    self.f_a_proj = proj("f_a_proj", (d,), (c.gate_rank,), (ax.EMBED,), (ax.LOW_RANK,), None)
    self.f_b_proj = proj("f_b_proj", (c.gate_rank,), (h, hd), (ax.LOW_RANK,),
                         (ax.HEADS, ax.HEAD_DIM), None)
    # the released models' decay initialisation, from the counter-based draws
    self.A_log = nnx.Param(jnp.log(_uniform(init, (h,), *A_RANGE)), **logical(ax.HEADS))
    dt = jnp.exp(_uniform(init, (h, hd), *map(math.log, DT_RANGE)))
    self.dt_bias = nnx.Param(dt_bias_for(dt), **logical(ax.HEADS, ax.HEAD_DIM))
    self.b_proj = proj("b_proj", (d,), (h,), (ax.EMBED,), (ax.HEADS,), None)
    if c.output_gate_rank > 0:
      self.g_a_proj = proj("g_a_proj", (d,), (c.output_gate_rank,), (ax.EMBED,), (ax.LOW_RANK,),
                           None)
      self.g_b_proj = proj("g_b_proj", (c.output_gate_rank,), (h, hd), (ax.LOW_RANK,),
                           (ax.HEADS, ax.HEAD_DIM), None)
    else:
      self.g_proj = proj("g_proj", (d,), (h, hd), (ax.EMBED,), (ax.HEADS, ax.HEAD_DIM), None)
    self.o_norm = nnx.Param(jnp.ones((hd,), jnp.float32), **logical(ax.HEAD_DIM))

  def decay_gate(self) -> DecayGate:
    """The per-channel log decay g <= 0 as a function of the gate projection f_b(f_a(x))."""
    return DecayGate(self.A_log[...], self.dt_bias[...], self.cfg.gate_lower_bound)

  def _output_gate(self, x: jax.Array) -> jax.Array:
    if self.cfg.output_gate_rank > 0:
      return self.g_b_proj(self.g_a_proj(x))
    return self.g_proj(x)

  def __call__(self, x: jax.Array, ctx: ForwardContext):
    key = ctx.dropout_key
    names = (ax.BATCH, ax.SEQ, ax.HEADS, ax.HEAD_DIM)

    prologue = ops.resolve("short_conv", ctx.execution.kernels)

    def mixed(projection, conv_weight, normalize):
      # The projection is the save point: conv, SiLU and the norm are cheap to recompute.
      p = constrain(save_points.tag(projection(x, key), save_points.QKV), names)
      return constrain(prologue(p, conv_weight[...], ctx.segment_ids, normalize=normalize), names)

    q = mixed(self.q_proj, self.q_conv, True)
    k = mixed(self.k_proj, self.k_conv, True)
    v = mixed(self.v_proj, self.v_conv, False)
    f = constrain(save_points.tag(self.f_b_proj(self.f_a_proj(x)), save_points.GATES), names)
    beta = save_points.tag(jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32)), save_points.GATES)
    kda = ops.resolve("linear_attention.kda", ctx.execution.kernels)
    # q and k leave the prologue L2-normalised
    o, _ = kda(q, k, v, f, beta, segment_ids=ctx.segment_ids, normalize_qk=False,
               decay=self.decay_gate())
    o = save_points.tag(o, save_points.ATTENTION)
    gate = constrain(save_points.tag(self._output_gate(x), save_points.GATES), names)
    # Gated RMSNorm entirely in fp32: the norm, its weight and the sigmoid gate.
    o = (rms_norm(o.astype(jnp.float32), self.o_norm[...], self.norm_eps) *
         jax.nn.sigmoid(gate.astype(jnp.float32)))
    return save_points.tag(self.o_proj(o.astype(x.dtype), key), save_points.MIXER_OUT), {}

"""Gated MLP (SwiGLU, or SiTU-GLU per `model.activation`) with a fused gate_up projection
(LoRA target) and a frozen down projection."""

from __future__ import annotations

import jax
from flax import nnx

from hylora.model.init import ParamInit

from meshes import logical_axes as ax
from hylora.core import save_points
from hylora.core.config import LoRAConfig, ModelConfig
from hylora.model.ffn.activations import Activation
from hylora.model.lora import Linear


class SwiGLU(nnx.Module):

  def __init__(self, d: int, ffn: int, *, lora: LoRAConfig | None, init_std: float, init: ParamInit,
               activation: Activation, dtype: str = "bfloat16", name: str = "gate_up"):
    # `name`: what LoRA targets call the fused gate_up (the dense MLP's, the shared experts')
    self.gate_up = Linear((d,), (2 * ffn,), (ax.EMBED,), (ax.MLP,), name=name, lora=lora, init=init,
                          init_std=init_std, dtype=dtype)
    self.down = Linear((ffn,), (d,), (ax.MLP,), (ax.EMBED,), name="down", lora=lora, init=init,
                       init_std=init_std, dtype=dtype)
    self.activation = activation

  def __call__(self, x: jax.Array, dropout_key=None) -> jax.Array:
    h = save_points.tag(self.gate_up(x, dropout_key), save_points.MLP_GATE_UP)
    gate, up = jax.numpy.split(h, 2, axis=-1)
    return save_points.tag(self.down(self.activation(gate, up), dropout_key), save_points.MLP_DOWN)


class DenseFFN(nnx.Module):
  """The FFN of the first `dense_layers` layers."""

  def __init__(self, m: ModelConfig, lora: LoRAConfig | None, *, init: ParamInit):
    self.mlp = SwiGLU(m.d_model, m.dense_ffn, lora=lora, init_std=m.init_std, init=init,
                      activation=Activation.of(m), dtype=m.weight_dtype)

  def __call__(self, x: jax.Array, ctx):
    return self.mlp(x, ctx.dropout_key), {}

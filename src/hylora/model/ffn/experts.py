"""Routed experts: stacked gated-MLP weights [E, ...] with per-expert LoRA on gate_up,
computed as grouped matmuls over rows sorted by expert."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from hylora.model.init import ParamInit, logical, weight_std

from meshes import logical_axes as ax
from hylora import ops
from hylora.core import save_points
from hylora.core.config import KernelConfig, LoRAConfig, ModelConfig
from hylora.model.ffn.activations import Activation
from hylora.model.ffn.placement import initial_placement
from hylora.core.architecture import lora_targets
from hylora.model.lora import LoRAParam, dropout
from hylora.quant.matmul import frozen_grouped_matmul


class RoutedExperts(nnx.Module):

  def __init__(self, m: ModelConfig, lora: LoRAConfig | None, *, init: ParamInit,
               width: int | None = None):
    """`width`: the rows' width the experts read and write (default d_model; the latent
    MoE's experts run on its latent projection)."""
    moe = m.moe
    e, d, f = moe.experts, width or m.d_model, moe.expert_ffn
    self.activation = Activation.of(m)

    # Drawn per expert, then stored per slot: spare slots start as copies (placement.py).
    table = initial_placement(e, moe.slots)
    per_slot = lambda rows: jnp.take(rows, table, axis=0)

    def weight(shape):
      return per_slot(
          init.normal(shape, weight_std(m.init_std, shape[1]), jnp.dtype(m.weight_dtype), clip=2.0))

    self.gate_up = nnx.Param(weight((e, d, 2 * f)), **logical(ax.EXP, ax.EMBED, ax.EXP_MLP))
    self.down = nnx.Param(weight((e, f, d)), **logical(ax.EXP, ax.EXP_MLP, ax.EMBED))
    self.lora_a = nnx.data(None)
    self.lora_b = nnx.data(None)
    self.shared_a = False
    if lora_targets(lora, "experts"):
      self.shared_a = lora.shared_expert_a
      a_shape = (d, lora.rank) if self.shared_a else (e, d, lora.rank)
      a_axes = (ax.EMBED, ax.LORA_RANK) if self.shared_a else (ax.EXP, ax.EMBED, ax.LORA_RANK)
      a = init.normal(a_shape, 1.0 / math.sqrt(d))
      self.lora_a = LoRAParam(a if self.shared_a else per_slot(a), **logical(*a_axes))
      self.lora_b = LoRAParam(jnp.zeros((moe.slots, lora.rank, 2 * f), jnp.float32),
                              **logical(ax.EXP, ax.LORA_RANK, ax.EXP_MLP))
      self.lora_scale = lora.scale
      self.lora_dropout = lora.dropout

  def weights(self) -> dict:
    """The arrays `expert_ffn` needs (the dispatcher may shard_map them)."""
    w = {"gate_up": self.gate_up.get_value(), "down": self.down.get_value()}
    if self.lora_a is not None:
      w["lora_a"], w["lora_b"] = self.lora_a[...], self.lora_b[...]
    return w

  def options(self, kernels: KernelConfig) -> dict:
    """`expert_ffn`'s keyword arguments besides the weights."""
    if self.lora_a is None:
      return {"kernels": kernels, "activation": self.activation}
    return {
        "kernels": kernels,
        "activation": self.activation,
        "lora_scale": self.lora_scale,
        "lora_dropout": self.lora_dropout,
        "shared_a": self.shared_a
    }


def expert_ffn(weights: dict, x: jax.Array, group_sizes: jax.Array, *, kernels,
               activation: Activation = Activation(), lora_scale: float = 0.0,
               lora_dropout: float = 0.0, shared_a: bool = False, dropout_key=None) -> jax.Array:
  """The gated MLP of rows x [M, d] sorted by expert; group_sizes [G] over the G experts whose
  weights are given ([G, ...] stacks). Rows past sum(group_sizes) come out zero."""
  gmm = ops.resolve("grouped_matmul", kernels)
  x = save_points.tag(x, save_points.EXPERT_INPUT)
  h = frozen_grouped_matmul(x, weights["gate_up"], group_sizes, kernels)
  if "lora_a" in weights:
    xd = dropout(x, lora_dropout, dropout_key, "experts.gate_up")
    b = weights["lora_b"].astype(x.dtype)
    if shared_a:
      xa = jnp.dot(xd, weights["lora_a"].astype(x.dtype), preferred_element_type=jnp.float32)
      lora_out = lora_scale * gmm(xa.astype(x.dtype), b, group_sizes)
    else:
      glora = ops.resolve("grouped_lora", kernels)
      lora_out = glora(xd, weights["lora_a"].astype(x.dtype), b, group_sizes, lora_scale)
    h = h + lora_out.astype(h.dtype)
  h = save_points.tag(h, save_points.EXPERT_GATE_UP)
  gate, up = jnp.split(h, 2, axis=-1)
  y = frozen_grouped_matmul(
      activation(gate, up).astype(x.dtype), weights["down"], group_sizes, kernels)
  return save_points.tag(y, save_points.EXPERT_DOWN)

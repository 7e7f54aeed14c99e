"""Shared by the expert-parallel dispatcher's tests: a small MoE layer whose adapters
matter, and ragged_all_to_all emulated where XLA lacks it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from hylora.model.ffn.moe import MoE
from hylora.model.init import ParamInit
from tests.helpers import small_config


def ep_config(dispatch, lora=None, **moe):
  """small_config() with MoE fields `moe` (and LoRA fields `lora`) replaced."""
  cfg = small_config()
  moe_cfg = dataclasses.replace(cfg.model.moe, dispatch=dispatch, **moe)
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe_cfg))
  if lora:
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, **lora))
  return cfg


def ep_layer(cfg):
  """The MoE layer of `cfg` with non-zero LoRA B factors (the adapters matter and A gets
  gradients)."""

  def build():
    layer = MoE(cfg.model, cfg.lora, init=ParamInit(0))
    init = ParamInit(1)
    for b in (layer.experts.lora_b, layer.shared.gate_up.lora_b):
      b[...] = init.normal(b.shape, 0.5)
    return layer

  return nnx.jit(build)()  # one compile instead of hundreds of eager initialisers


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """ragged_all_to_all's contract from all_gathers (XLA:CPU has no ragged collective)."""
  ranks = jax.lax.axis_size(axis_name)
  me = jax.lax.axis_index(axis_name)
  gather = lambda a: jax.lax.all_gather(a, axis_name)
  operands, in_off, sizes, out_off = map(gather,
                                         (operand, input_offsets, send_sizes, output_offsets))
  rows = jnp.arange(output.shape[0])
  for src in range(ranks):
    start, count = out_off[src, me], sizes[src, me]
    inside = (rows >= start) & (rows < start + count)
    take = jnp.clip(in_off[src, me] + rows - start, 0, operand.shape[0] - 1)
    output = jnp.where(inside[:, None], operands[src][take], output)
  return output

"""Frozen bf16 (or packed, hylora.quant) linears with optional LoRA adapters.

The base kernel is an `nnx.Param` (frozen: it never enters the optimizer and only input
gradients flow through it). Adapters are `LoRAParam`s kept in fp32; B starts at zero so
the adapted model reproduces the base model exactly before the first update.
"""

from __future__ import annotations

import math
import zlib
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from hylora.model import execution
from hylora.model.init import ParamInit, logical, weight_std
from hylora.quant import is_packed
from hylora.quant.matmul import packed_linear

from meshes import logical_axes as ax
from hylora.core import save_points
from hylora.core.architecture import lora_targets
from hylora.core.config import LoRAConfig


class LoRAParam(nnx.Variable):
  """A trainable adapter factor (the only variables the optimizer sees)."""


def dropout(x: jax.Array, rate: float, key: jax.Array | None, salt: str) -> jax.Array:
  """Inverted dropout on the adapter input; a no-op without a key (evaluation)."""
  if rate <= 0.0 or key is None:
    return x
  key = jax.random.fold_in(key, zlib.crc32(salt.encode()))
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def _contract(x: jax.Array, w: jax.Array, n_in: int, *, fp32_result: bool) -> jax.Array:
  """x[..., *in] . w[*in, *out] -> [..., *out] in x's dtype, accumulated in fp32.

  With fp32_result the product comes out in fp32 and is rounded after: the backward's
  transposed products then take fp32 cotangents and run in fp32, as the adapter factors'
  gradients want. Without, the product comes out in x's dtype (XLA's GPU and CPU
  matmuls accumulate bf16 products in fp32 and round once: the same values) and so does
  the input gradient's product, in bf16 on the tensor cores; the fp32 form would make the
  frozen kernels' input gradients fp32 matmuls (what that cost: docs/performance.md).
  """
  lhs = tuple(range(x.ndim - n_in, x.ndim))
  y = jax.lax.dot_general(x, w.astype(x.dtype), ((lhs, tuple(range(n_in))), ((), ())),
                          preferred_element_type=jnp.float32 if fp32_result else None)
  return y.astype(x.dtype)


class Linear(nnx.Module):
  """y = x W (+ scale * x A B when `name` matches a LoRA target)."""

  def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], in_axes: Sequence[str],
               out_axes: Sequence[str], *, name: str, lora: LoRAConfig | None, init: ParamInit,
               init_std: float = 0.0, dtype="bfloat16"):
    self.name = name
    self.n_in = len(in_shape)
    shape = (*in_shape, *out_shape)
    w = init.normal(shape, weight_std(init_std, math.prod(in_shape)), jnp.dtype(dtype), clip=2.0)
    self.kernel = nnx.Param(w, **logical(*in_axes, *out_axes))
    self.lora_a = nnx.data(None)
    self.lora_b = nnx.data(None)
    self.lora_scale = 0.0
    self.lora_dropout = 0.0
    if lora_targets(lora, name):
      fan_in = math.prod(in_shape)
      a = init.normal((*in_shape, lora.rank), 1.0 / math.sqrt(fan_in))
      self.lora_a = LoRAParam(a, **logical(*in_axes, ax.LORA_RANK))
      self.lora_b = LoRAParam(jnp.zeros((lora.rank, *out_shape), jnp.float32),
                              **logical(ax.LORA_RANK, *out_axes))
      self.lora_scale = lora.scale
      self.lora_dropout = lora.dropout

  def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
    kernel = self.kernel.get_value()
    if is_packed(kernel):  # as the checkpoint ships it (hylora.quant)
      y = packed_linear(x, kernel, execution.current().kernels)
    else:
      y = _contract(x, kernel, self.n_in, fp32_result=False)
    if self.lora_a is not None:
      xa = _contract(dropout(x, self.lora_dropout, dropout_key, self.name), self.lora_a[...],
                     self.n_in, fp32_result=True)
      xa = save_points.tag(xa, save_points.LORA_A)
      y = y + (self.lora_scale * _contract(xa, self.lora_b[...], 1, fp32_result=True)).astype(
          y.dtype)
    return y

"""Products with frozen weights that may be packed: the model's linears and routed
experts call these, and the op registry picks the kernel (`kernels.quantized_matmul`:
on GPU the Pallas kernels that dequantize tiles on the way into the matrix units)."""

from __future__ import annotations

import jax

from hylora import ops
from hylora.quant.packed_weight import PackedWeight


def packed_linear(x: jax.Array, w: PackedWeight, kernels=None) -> jax.Array:
  """x [..., *in] @ w -> [..., *out] in x's dtype."""
  n_in = len(w.in_shape)
  lead = x.shape[:x.ndim - n_in]
  matmul = ops.resolve("quantized_matmul", kernels)
  y = matmul(x.reshape(*lead, w.k), w.codes, w.scales, fmt=w.format)
  return y.reshape(*lead, *w.out_shape)


def frozen_grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, kernels=None) -> jax.Array:
  """Rows x [M, K] sorted by group times each group's weight: w a bf16 stack [G, K, N]
  (`grouped_matmul`) or a `PackedWeight` of G matrices. Rows past the groups give 0."""
  if isinstance(w, PackedWeight):
    matmul = ops.resolve("quantized_grouped_matmul", kernels)
    return matmul(x, w.codes, w.scales, group_sizes, fmt=w.format)
  return ops.resolve("grouped_matmul", kernels)(x, w.astype(x.dtype), group_sizes)

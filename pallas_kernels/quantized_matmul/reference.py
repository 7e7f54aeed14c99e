"""Plain-JAX references for matmuls against packed frozen weights: dequantize the whole
weight to bfloat16 (formats.dequantize), then the bf16 product (`jax.lax.ragged_dot`,
which the grouped_matmul family treats as ground truth)."""

import jax
import jax.numpy as jnp

from .formats import dequantize


def quantized_grouped_matmul_reference(lhs, codes, scales, group_sizes, *, fmt: str):
  """lhs [M, K] @ W[g]^T per group, W [G, N, K] the packed weight -> [M, N] (rows past
  sum(group_sizes): 0)."""
  w = dequantize(codes, scales, fmt, lhs.dtype)  # [G, N, K]
  return jax.lax.ragged_dot(lhs, jnp.swapaxes(w, 1, 2), group_sizes.astype(jnp.int32))


def quantized_matmul_reference(x, codes, scales, *, fmt: str):
  """x [..., K] @ W^T, W [N, K] the packed weight -> [..., N]."""
  w = dequantize(codes, scales, fmt, x.dtype)
  # x's dtype in and out, as a bf16 frozen linear computes it (fp32 accumulation inside)
  return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))

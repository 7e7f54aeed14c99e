"""Plain-JAX reference for grouped (per-expert) matrix products.

Rows of `lhs` are sorted by group: the first group_sizes[0] rows use rhs[0], the next
group_sizes[1] rows use rhs[1], and so on. Rows past sum(group_sizes) produce zeros.
This is exactly `jax.lax.ragged_dot`, which the tests treat as ground truth.
"""

import jax

from .input_checks import check_grouped_matmul_inputs, check_grouped_lora_inputs


def grouped_matmul_reference(lhs, rhs, group_sizes):
  """lhs [M, K], rhs [G, K, N], group_sizes [G] int32 -> [M, N]."""
  check_grouped_matmul_inputs(lhs, rhs, group_sizes)
  return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def grouped_lora_reference(x, a, b, group_sizes, scale):
  """scale * (x @ a[g]) @ b[g] per group: x [M, K], a [G, K, r], b [G, r, N] -> [M, N]."""
  check_grouped_lora_inputs(x, a, b, group_sizes)
  hidden = jax.lax.ragged_dot(x, a, group_sizes)
  return (scale * jax.lax.ragged_dot(hidden, b, group_sizes)).astype(x.dtype)

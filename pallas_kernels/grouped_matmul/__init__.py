"""Grouped (per-expert) matmuls for mixture-of-experts layers.

    grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]
    grouped_lora(x [M, K], a [G, K, r], b [G, r, N], group_sizes [G], scale) -> [M, N]

Both follow `jax.lax.ragged_dot`: rows are sorted by group, rows past sum(group_sizes)
give zeros. On GPU the forward and input gradient run on jax's Hopper Mosaic kernel
(`mosaic_kernel.py`); elsewhere, and for shapes that kernel cannot take, on XLA's
ragged_dot. See grouped_matmul.py for the gradient rules.
"""

import jax

from .grouped_lora import make_grouped_lora
from .grouped_matmul import make_grouped_matmul
from .mosaic_kernel import mosaic_ragged_dot, xla_ragged_dot
from .reference import grouped_lora_reference, grouped_matmul_reference


def _kernel(lhs, rhs, group_sizes, *, transpose_rhs):
  # Chosen when traced, so the same function runs on CPU (CI) and on the GPU.
  if jax.default_backend() == "gpu":
    return mosaic_ragged_dot(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)
  return xla_ragged_dot(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)


grouped_matmul = make_grouped_matmul(_kernel)
grouped_lora = make_grouped_lora(grouped_matmul)

__all__ = [
    "grouped_matmul",
    "grouped_lora",
    "make_grouped_matmul",
    "make_grouped_lora",
    "grouped_matmul_reference",
    "grouped_lora_reference",
]

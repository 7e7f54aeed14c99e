"""Hopper grouped matmul: jax's Mosaic GPU `ragged_dot_mgpu` behind a shape-safe wrapper.

The kernel runs warpgroup matrix instructions over (block_m x block_n) output tiles,
one persistent program per SM, and writes only the rows that belong to a group. What it
cannot take is routed elsewhere:
  * M not a multiple of block_m: lhs is padded with zero rows (they lie past
    sum(group_sizes), so they never reach the output);
  * K not a multiple of block_k, N not a multiple of block_n (e.g. a LoRA rank of 16),
    mixed or non-16-bit dtypes: `jax.lax.ragged_dot` (XLA), which is correct but slow.
Rows past sum(group_sizes) are left unwritten by the kernel; the caller zeroes them.
"""

import jax
import jax.numpy as jnp

BLOCK_M = 128
BLOCK_N = 128
BLOCK_K = 64
PIPELINE_STAGES = 4


def _xla_ragged_dot(lhs, rhs, group_sizes, transpose_rhs):
  if transpose_rhs:
    rhs = jnp.swapaxes(rhs, 1, 2)
  return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def fits_mosaic_kernel(lhs, rhs, transpose_rhs: bool) -> bool:
  """Whether the Mosaic kernel can take these operands (else XLA's ragged_dot)."""
  k, n = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else (rhs.shape[1], rhs.shape[2])
  same_16bit = lhs.dtype == rhs.dtype and lhs.dtype in (jnp.bfloat16, jnp.float16)
  return same_16bit and k % BLOCK_K == 0 and n % BLOCK_N == 0


def _grid_block_n(n: int) -> int:
  # Column tiles visited together by the snake order; must divide the tile count.
  tiles = n // BLOCK_N
  return next(c for c in (8, 4, 2, 1) if tiles % c == 0)


def mosaic_ragged_dot(lhs, rhs, group_sizes, *, transpose_rhs: bool = False):
  """lhs [M, K] @ rhs[g] ([G, K, N], or [G, N, K] if transpose_rhs) -> [M, N].

    Rows at or past sum(group_sizes) hold unspecified values.
    """
  if not fits_mosaic_kernel(lhs, rhs, transpose_rhs):
    return _xla_ragged_dot(lhs, rhs, group_sizes, transpose_rhs)
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

  m = lhs.shape[0]
  padded_m = -(-m // BLOCK_M) * BLOCK_M
  if padded_m != m:
    lhs = jnp.pad(lhs, ((0, padded_m - m), (0, 0)))
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  out = ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=group_sizes.astype(jnp.int32),
                                   block_m=BLOCK_M, block_n=BLOCK_N, block_k=BLOCK_K,
                                   max_concurrent_steps=PIPELINE_STAGES,
                                   grid_block_n=_grid_block_n(n), transpose_rhs=transpose_rhs)
  return out[:m]


def xla_ragged_dot(lhs, rhs, group_sizes, *, transpose_rhs: bool = False):
  """The same contract through XLA (used on CPU and as the fallback)."""
  return _xla_ragged_dot(lhs, rhs, group_sizes, transpose_rhs)

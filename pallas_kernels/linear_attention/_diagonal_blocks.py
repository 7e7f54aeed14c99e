"""Diagonal 16x16 blocks of the in-chunk decayed products, by matmul where the decay allows.

Inside one 16-token sub-chunk, sum_d x_t[d] y_s[d] exp(b_t[d] - b_s[d]) factors through
the sub-chunk's first token r as (x_t exp(b_t - b_r)) . (y_s exp(b_r - b_s)): one
matmul of fp32 operands (TF32 tensor cores on GPU, Pallas's default for fp32; exact in
interpret mode) with fp32 accumulation, instead of 16 steps of [16, D] exps and
cross-thread row reductions. The factors are exps of numbers up to the sub-chunk's
decay range, so the kernels take this path only when every |b_t - b_r| in the sub-chunk
is at most FACTOR_LIMIT (exp(40) = 2.4e17: far from fp32 overflow and underflow, and
the product of the two factors is exp(b_t - b_s) to a few ulps); sub-chunks with
stronger decays (down to g = -20 per token) take the exact per-key loop.
"""
import jax
import jax.numpy as jnp

from pallas_kernels.linear_attention._pallas_common import F32, SUB, iota, mm

FACTOR_LIMIT = 40.0


def factorable(b_i, b_r):
  """Whether the sub-chunk with cumulative log decays b_i [16, D] (first row b_r [1, D])
    may factor its decays."""
  return jnp.max(jnp.abs(b_i - b_r)) <= FACTOR_LIMIT


def decay_factors(b_i, b_r):
  """(exp(b_t - b_r), exp(b_r - b_t)) per row t of the sub-chunk."""
  rel = b_i - b_r
  return jnp.exp(rel), jnp.exp(-rel)


def f32_mm(a, b, trans_a=False, trans_b=False):
  """fp32 operands and accumulation (TF32 on GPU: 10 mantissa bits, above the bf16 of
    the blocks below the diagonal)."""
  return mm(a, b, F32, trans_a=trans_a, trans_b=trans_b)


def lower(block, strict=False):
  """The block's entries with s <= t (s < t when strict), zero elsewhere."""
  t, s = iota(SUB, 0, (SUB, SUB)), iota(SUB, 1, (SUB, SUB))
  return jnp.where(s < t if strict else s <= t, block, 0.0)


def choose(b_i, b_r, factored, exact, *operands):
  """factored(*operands) when the sub-chunk's decays allow, else exact(*operands)."""
  return jax.lax.cond(factorable(b_i, b_r), factored, exact, *operands)

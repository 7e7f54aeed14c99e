"""Whole-chunk decay factoring through a per-channel midpoint, for chunks whose decays allow.

For any per-channel reference m, sum_d x_t[d] y_s[d] exp(b_t[d] - b_s[d]) equals
(x_t exp(b_t - m)) . (y_s exp(m - b_s)). With m the midpoint of the chunk's range of b in
each channel, every factor is exp(x) with |x| at most half that range. A chunk whose
channels each decay by at most 2 * FACTOR_LIMIT over its 64 tokens (a gate above -1.25
per token on average) is "bounded": every factor then lies in [exp(-40), exp(40)], far
from fp32 overflow and underflow, and each in-chunk decayed product (the scores A, the
score-gradient paths into dq and dk) is one [64, D] matmul of fp32 operands (TF32 on GPU,
exact in interpret mode) instead of 16-token sub-chunk blocks and diagonal blocks. Other
chunks take the sub-chunk path, whose every exponent is <= 0.
"""
import jax.numpy as jnp

from pallas_kernels.linear_attention._diagonal_blocks import FACTOR_LIMIT


def midpoint(b):
  """(m [1, D], bounded): the per-channel midpoint of b [C, D] and whether the chunk may
    factor its decays through it."""
  hi, lo = jnp.max(b, axis=0, keepdims=True), jnp.min(b, axis=0, keepdims=True)
  return 0.5 * (hi + lo), jnp.max(hi - lo) <= 2.0 * FACTOR_LIMIT


def factors(b, m):
  """(exp(b - m), exp(m - b)): the query-side and key-side factors of every token."""
  rel = b - m
  return jnp.exp(rel), jnp.exp(-rel)

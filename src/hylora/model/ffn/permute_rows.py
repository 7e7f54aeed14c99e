"""Gathering rows whose readers are known: the transpose as a gather, not a scatter.

`jnp.take(x, index, axis=0)` differentiates into a scatter-add of the cotangent into a
zeroed [rows, d] buffer: autodiff cannot know how often `index` repeats a row. In the MoE
dispatch every row is read a known, small number of times (a token by its top-k
choices, an expert output by one pair), so the transpose is a gather by the readers'
positions (and a k-way sum): no zeroed buffer, no scatter, no atomics on GPU (what the
scatter-add cost: docs/moe.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def permute_rows(x: jax.Array, perm: jax.Array, inverse: jax.Array) -> jax.Array:
  """x[perm] for a permutation `perm` of x's rows, `inverse` its inverse
  (inverse[perm[i]] = i)."""
  return jnp.take(x, perm, axis=0)


def _forward(x, perm, inverse):
  return jnp.take(x, perm, axis=0), (perm, inverse)


def _backward(residuals, dout):
  perm, inverse = residuals
  return jnp.take(dout, inverse, axis=0), None, None


permute_rows.defvjp(_forward, _backward)


@jax.custom_vjp
def gather_rows(x: jax.Array, index: jax.Array, readers: jax.Array,
                readers_valid: jax.Array) -> jax.Array:
  """x[index] ([M, d]) where row n of x is read by the output rows `readers[n]` ([N, k];
  entries with readers_valid False are ignored).

  Contract: every output row m with index[m] == n whose cotangent can be non-zero is
  one of n's valid readers (rows the caller masks out afterwards may be left out)."""
  return jnp.take(x, index, axis=0)


def _gather_forward(x, index, readers, readers_valid):
  # residuals must be arrays: an empty one carries x's dtype
  return jnp.take(x, index, axis=0), (readers, readers_valid, jnp.zeros((0,), x.dtype))


def _gather_backward(residuals, dout):
  readers, readers_valid, like_x = residuals
  n, k = readers.shape
  per_reader = jnp.take(dout, readers.reshape(-1), axis=0).reshape(n, k, -1)
  per_reader = jnp.where(readers_valid[..., None], per_reader.astype(jnp.float32), 0.0)
  return per_reader.sum(1).astype(like_x.dtype), None, None, None


gather_rows.defvjp(_gather_forward, _gather_backward)

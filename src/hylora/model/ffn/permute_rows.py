"""Reordering rows by a permutation whose inverse is known.

`jnp.take(x, perm, axis=0)` differentiates into a scatter-add of the cotangent into a
zeroed [rows, d] buffer: autodiff cannot know that `perm` repeats no row. For a
permutation the transpose is the gather by the inverse permutation, with no zeroed
buffer and no scatter (on GPU: no atomics).
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

"""permute_rows: a row permutation whose gradient is the inverse permutation's gather."""

import jax
import jax.numpy as jnp
import numpy as np

from hylora.model.ffn.permute_rows import permute_rows


def test_value_and_gradient_match_take():
  x = jax.random.normal(jax.random.key(0), (12, 5))
  perm = jax.random.permutation(jax.random.key(1), 12).astype(jnp.int32)
  inverse = jnp.zeros_like(perm).at[perm].set(jnp.arange(12, dtype=jnp.int32))
  cot = jax.random.normal(jax.random.key(2), (12, 5))
  np.testing.assert_array_equal(permute_rows(x, perm, inverse), jnp.take(x, perm, axis=0))
  got = jax.grad(lambda x: jnp.sum(permute_rows(x, perm, inverse) * cot))(x)
  want = jax.grad(lambda x: jnp.sum(jnp.take(x, perm, axis=0) * cot))(x)
  np.testing.assert_array_equal(got, want)


def test_backward_is_a_gather_not_a_scatter():
  perm = jnp.arange(8, dtype=jnp.int32)[::-1]
  text = jax.jit(jax.grad(lambda x: jnp.sum(permute_rows(x, perm, perm) ** 2))).lower(
      jnp.ones((8, 3))).as_text()
  assert "scatter" not in text and "gather" in text

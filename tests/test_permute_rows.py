"""permute_rows and gather_rows: row gathers whose gradients are gathers, not scatters."""

import jax
import jax.numpy as jnp
import numpy as np

from hylora.model.ffn.permute_rows import gather_rows, permute_rows


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
  text = jax.jit(jax.grad(lambda x: jnp.sum(permute_rows(x, perm, perm)**2))).lower(jnp.ones(
      (8, 3))).as_text()
  assert "scatter" not in text and "gather" in text


def _top_k_dispatch(n=10, k=3, seed=0):
  """A token-to-pair gather as the MoE does it: pairs sorted by a random expert."""
  experts = jax.random.randint(jax.random.key(seed), (n * k,), 0, 4)
  order = jnp.argsort(experts, stable=True).astype(jnp.int32)
  inverse = jnp.argsort(order).astype(jnp.int32)
  return (order // k).astype(jnp.int32), inverse.reshape(n, k)


def test_gather_rows_value_and_gradient_match_take():
  index, readers = _top_k_dispatch()
  x = jax.random.normal(jax.random.key(1), (10, 6))
  cot = jax.random.normal(jax.random.key(2), (30, 6))
  valid = jnp.ones(readers.shape, bool)
  np.testing.assert_array_equal(gather_rows(x, index, readers, valid), jnp.take(x, index, axis=0))
  got = jax.grad(lambda x: jnp.sum(gather_rows(x, index, readers, valid) * cot))(x)
  want = jax.grad(lambda x: jnp.sum(jnp.take(x, index, axis=0) * cot))(x)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_gather_rows_ignores_invalid_readers_of_masked_rows():
  # rows 3 and 7 of the output are masked out after the gather: their readers are invalid
  index, readers = _top_k_dispatch(seed=3)
  keep = jnp.ones((30,), bool).at[jnp.array([3, 7])].set(False)
  valid = keep[readers]
  x = jax.random.normal(jax.random.key(4), (10, 6))
  cot = jax.random.normal(jax.random.key(5), (30, 6))
  masked = lambda rows: jnp.where(keep[:, None], rows, 0.0)
  got = jax.grad(lambda x: jnp.sum(masked(gather_rows(x, index, readers, valid)) * cot))(x)
  want = jax.grad(lambda x: jnp.sum(masked(jnp.take(x, index, axis=0)) * cot))(x)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  # a wrong reader list gives a wrong gradient: the test can tell
  wrong = jax.grad(lambda x: jnp.sum(
      masked(gather_rows(x, index, readers, keep[:10, None].repeat(3, 1))) * cot))(x)
  assert not np.allclose(wrong, want)


def test_gather_rows_backward_is_a_gather_not_a_scatter():
  index, readers = _top_k_dispatch()
  valid = jnp.ones(readers.shape, bool)
  text = jax.jit(jax.grad(lambda x: jnp.sum(gather_rows(x, index, readers, valid)**2))).lower(
      jnp.ones((10, 6))).as_text()
  assert "scatter" not in text and "gather" in text

"""The per-row top-K kernel against jax.lax.top_k (the same sets, ties to the smaller
index), with and without row lengths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_attention.tests.helpers import lax_top_k_sets, tied_scores
from pallas_kernels.sparse_attention.top_k_kernel import kernel_top_k


@pytest.mark.parametrize("k, bits", [(1, 1), (1, 4), (7, 2), (40, 1), (40, 4)])
def test_same_sets_as_lax_top_k_with_ties_infinities_and_signed_zeros(k, bits):
  scores = tied_scores()
  got = np.asarray(kernel_top_k(scores, k, bits_per_pass=bits, block=16))
  np.testing.assert_array_equal(np.sort(got, axis=-1), lax_top_k_sets(scores, k))
  assert (got[0, 0] >= 0).sum() == min(k, 5)
  for row in got.reshape(-1, k):  # the taken indices ascending, then the -1 fill
    n = (row >= 0).sum()
    assert (np.diff(row[:n]) > 0).all() and (row[n:] == -1).all()


def test_lengths_limit_each_row_and_what_lies_past_them_is_never_read():
  scores = jax.random.normal(jax.random.key(1), (4, 300)) * 1e3
  lengths = jnp.array([0, 5, 150, 300])
  inside = jnp.arange(300)[None, :] < lengths[:, None]
  # NaN past each row's length: it would change any count that read it
  got = kernel_top_k(jnp.where(inside, scores, jnp.nan), 33, lengths, block=64)
  np.testing.assert_array_equal(np.sort(np.asarray(got), axis=-1),
                                lax_top_k_sets(jnp.where(inside, scores, -jnp.inf), 33))
  assert (np.asarray(got[1]) >= 0).sum() == 5 and (np.asarray(got[0]) == -1).all()


def test_rows_longer_than_a_block_and_k_over_several_blocks():
  scores = jax.random.normal(jax.random.key(2), (2, 3, 1000))
  got = kernel_top_k(scores, 70, bits_per_pass=2, block=32)
  np.testing.assert_array_equal(np.sort(np.asarray(got), axis=-1), lax_top_k_sets(scores, 70))


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="k must be in"):
    kernel_top_k(jnp.zeros((2, 8)), 9)
  with pytest.raises(ValueError, match="bits_per_pass must be one of"):
    kernel_top_k(jnp.zeros((2, 8)), 3, bits_per_pass=3)
  with pytest.raises(ValueError, match="block must be a power of 2"):
    kernel_top_k(jnp.zeros((2, 8)), 3, block=48)

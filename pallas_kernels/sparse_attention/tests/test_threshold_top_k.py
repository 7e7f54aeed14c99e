"""Top-K by threshold against jax.lax.top_k (the same sets, ties to the smaller index)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_attention.tests.helpers import lax_top_k_sets, tied_scores
from pallas_kernels.sparse_attention.threshold_top_k import threshold_top_k


@pytest.mark.parametrize("bits", [1, 4])
@pytest.mark.parametrize("k", [1, 7, 40])
def test_same_sets_as_lax_top_k_with_ties_infinities_and_signed_zeros(k, bits):
  scores = tied_scores()
  got = np.sort(np.asarray(jax.jit(threshold_top_k, static_argnums=(1, 2))(scores, k, bits)),
                axis=-1)
  np.testing.assert_array_equal(got, lax_top_k_sets(scores, k))
  assert (got[0, 0] >= 0).sum() == min(k, 5)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_same_sets_on_continuous_scores(bits):
  scores = jax.random.normal(jax.random.key(1), (4, 300)) * 1e3
  got = np.sort(np.asarray(threshold_top_k(scores, 33, bits)), axis=-1)
  np.testing.assert_array_equal(got, lax_top_k_sets(scores, 33))


def test_k_outside_the_row_and_unknown_digit_widths_are_refused():
  with pytest.raises(ValueError, match="k must be in"):
    threshold_top_k(jnp.zeros((2, 8)), 9)
  with pytest.raises(ValueError, match="bits_per_pass must be one of"):
    threshold_top_k(jnp.zeros((2, 8)), 3, bits_per_pass=3)

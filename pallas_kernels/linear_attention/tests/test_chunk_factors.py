"""The whole-chunk decay factoring: which chunks may take it, and that it is exact."""
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.linear_attention import _chunk_factors as factors
from pallas_kernels.linear_attention._diagonal_blocks import FACTOR_LIMIT
from pallas_kernels.linear_attention._inputs import CHUNK


def _chunk_decays(span, seed=0):
  """b [C, 8]: cumulative log decays whose widest channel falls by exactly `span`."""
  g = -jax.random.uniform(jax.random.key(seed), (CHUNK, 8))
  b = jnp.cumsum(g, axis=0)
  return b * (span / (b[0] - b[-1]).max())


def test_bounded_up_to_twice_the_factor_limit():
  for span, bounded in ((2 * FACTOR_LIMIT - 0.5, True), (2 * FACTOR_LIMIT + 0.5, False)):
    b = _chunk_decays(span)
    m, ok = factors.midpoint(b)
    assert bool(ok) == bounded, span
    # every factor's exponent is within half the widest channel's range
    assert float(jnp.abs(b - m).max()) <= span / 2 + 1e-4


def test_factors_multiply_to_the_decay_between_any_two_tokens():
  b = _chunk_decays(2 * FACTOR_LIMIT - 1.0, seed=1)
  m, _ = factors.midpoint(b)
  down, up = factors.factors(b, m)
  pairs = down[:, None, :] * up[None, :, :]  # [t, s, d]
  exact = jnp.exp(b[:, None, :] - b[None, :, :])
  t, s = np.tril_indices(CHUNK)
  np.testing.assert_allclose(pairs[t, s], exact[t, s], rtol=2e-5, atol=1e-30)

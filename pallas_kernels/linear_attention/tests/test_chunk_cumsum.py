"""The in-chunk cumulative decay kernel and its transpose against jnp.cumsum."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear_attention._chunk_cumsum import chunk_cumsum
from pallas_kernels.linear_attention._inputs import CHUNK


def _reference(g):
  B, Tp, H, D = g.shape
  per_chunk = g.astype(jnp.float32).reshape(B, Tp // CHUNK, CHUNK, H, D)
  return jnp.cumsum(per_chunk, axis=2).reshape(g.shape)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunk_cumsum_and_its_transpose(dtype):
  kg, kc = jax.random.split(jax.random.PRNGKey(7))
  g = (-20.0 * jax.random.uniform(kg, (2, 3 * CHUNK, 3, 64))).astype(dtype)
  ct = jax.random.normal(kc, g.shape)
  out, vjp = jax.vjp(chunk_cumsum, g)
  ref_out, ref_vjp = jax.vjp(_reference, g)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-4)
  (grad,), (ref_grad,) = vjp(ct), ref_vjp(ct)
  assert grad.dtype == dtype
  tol = 1e-5 if dtype == jnp.float32 else 1e-2  # both cast an fp32 sum to bf16
  np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(ref_grad, np.float32),
                             rtol=tol, atol=tol)


def test_the_unsummed_decays_for_a_summing_kernel():
  """prepare(summed=False) hands the padded log decays through (zeros past the end, no
  decay) for a scores kernel that sums them, and reverse_chunk_cumsum is the sum's
  transpose; a decay gate's input, which only its own kernel turns into decays, is
  refused."""
  from pallas_kernels.linear_attention import _chunk_prep
  from pallas_kernels.linear_attention._chunk_cumsum import reverse_chunk_cumsum
  from pallas_kernels.linear_attention.decay_gate import DecayGate
  g = -jax.random.uniform(jax.random.PRNGKey(3), (1, CHUNK + 5, 2, 16))
  x = jnp.ones((1, CHUNK + 5, 2, 16), jnp.bfloat16)
  unsummed = _chunk_prep.prepare(x, x, x, g, None, 1, CHUNK + 5, summed=False)[3]
  np.testing.assert_array_equal(unsummed[:, :CHUNK + 5], g)
  assert unsummed.shape[1] == 2 * CHUNK and not unsummed[:, CHUNK + 5:].any()
  ct = jax.random.normal(jax.random.PRNGKey(4), unsummed.shape)
  np.testing.assert_allclose(reverse_chunk_cumsum(ct),
                             jax.vjp(_reference, unsummed)[1](ct)[0], rtol=1e-5, atol=1e-5)
  gate = DecayGate(jnp.zeros((2,)), jnp.zeros((2, 16)), -5.0)
  with pytest.raises(ValueError, match="summed=False.*takes the log decays g"):
    _chunk_prep.prepare(x, x, x, g, None, 1, CHUNK + 5, decay=gate, summed=False)

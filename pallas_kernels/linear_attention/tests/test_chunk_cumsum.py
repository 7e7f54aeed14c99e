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

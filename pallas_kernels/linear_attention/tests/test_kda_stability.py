"""Nearly parallel keys with weak decay: the in-chunk unit lower-triangular system is then
far from diagonal; a power-series inverse overflows fp32 there (errors ~1e18), a
triangular solve (forward substitution, or the kernel's recursive doubling, a product of
exact block inverses) stays exact."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear_attention import chunked_kda, kda_chunked, kda_recurrent
from pallas_kernels.linear_attention._kda_solve import halves_inverse, unit_lower_inverse
from pallas_kernels.linear_attention.tests._data import fast_jit, rel_rms


def _near_parallel_keys(B=1, T=128, H=1, D=32):
  ks = jax.random.split(jax.random.key(0), 4)
  k = jax.random.normal(ks[0], (1, 1, 1, D)) + 0.05 * jax.random.normal(ks[1], (B, T, H, D))
  q = jax.random.normal(ks[2], (B, T, H, D))
  v = jax.random.normal(ks[3], (B, T, H, D))
  return q, k, v, jnp.full((B, T, H, D), -1e-3), jnp.full((B, T, H), 0.95)


@pytest.mark.parametrize("fn", [kda_chunked, chunked_kda], ids=["reference", "pallas"])
def test_near_parallel_keys_forward(fn):
  x = _near_parallel_keys()
  o_ref, _ = fast_jit(kda_recurrent)(*x)
  o, _ = fast_jit(fn)(*x)
  assert rel_rms(o_ref, o) < 1e-4


def test_near_parallel_keys_reference_grads():
  x = _near_parallel_keys(T=80)
  loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)[0]))
  g_ref = fast_jit(jax.grad(loss(kda_recurrent), range(5)))(*x)
  g = fast_jit(jax.grad(loss(kda_chunked), range(5)))(*x)
  for name, a, b in zip(("q", "k", "v", "g", "beta"), g_ref, g):
    assert rel_rms(a, b) < 1e-4, name


@pytest.mark.parametrize("unrolled", [True, False], ids=["unrolled", "loop"])
@pytest.mark.parametrize("interpret", [True, False], ids=["fp32_products", "split_bf16_products"])
def test_doubling_inverse_of_near_parallel_keys(interpret, unrolled):
  """The solve kernel's inverse by recursive doubling, with its GPU products (bf16 halves,
    three tensor-core products: here in plain JAX) and its interpret-mode ones, against a
    float64 triangular solve, on a chunk of near-parallel keys (I + A far from diagonal).
    The split products keep 16 of fp32's 24 bits (1.6e-5 here), below the TF32 rounding of
    A itself that the scores kernel's products leave on the GPU. Unrolled (the solve's own
    kernel) and as a loop over the levels (the HALVES scores kernel, which solves in
    place)."""
  _, k, _, _, beta = _near_parallel_keys(T=64)
  k = k[0, :, 0] / jnp.linalg.norm(k[0, :, 0], axis=-1, keepdims=True)
  a = jnp.tril(beta[0, :, 0, None] * (k @ k.T), -1)
  exact = np.linalg.inv(np.eye(64) + np.asarray(a, np.float64))
  t = np.asarray(
      jax.jit(lambda a: unit_lower_inverse(a, interpret=interpret, unrolled=unrolled))(a),
      np.float64)
  assert np.linalg.norm(t - exact) / np.linalg.norm(exact) < (1e-6 if interpret else 5e-5)


@pytest.mark.parametrize("interpret", [True, False], ids=["fp32_products", "split_bf16_products"])
def test_inverse_by_halves_of_near_parallel_keys(interpret):
  """The solve kernel's inverse by halves (each 32-token half by doubling, joined by the
    block below them), assembled, against the float64 triangular solve on the chunk of
    near-parallel keys above, as accurate as the whole chunk's doubling; its block above
    the diagonal is zero."""
  _, k, _, _, beta = _near_parallel_keys(T=64)
  k = k[0, :, 0] / jnp.linalg.norm(k[0, :, 0], axis=-1, keepdims=True)
  a = jnp.tril(beta[0, :, 0, None] * (k @ k.T), -1)
  a = a + jnp.triu(jnp.full_like(a, jnp.nan))  # never read: on and above the diagonal
  exact = np.linalg.inv(np.eye(64) + np.nan_to_num(np.asarray(a, np.float64)))

  def by_halves(a):
    t00, t10, t11 = halves_inverse(lambda rows, cols: a[rows, cols], interpret)
    return jnp.block([[t00, jnp.zeros_like(t00)], [t10, t11]])

  t = np.asarray(jax.jit(by_halves)(a), np.float64)
  assert np.linalg.norm(t - exact) / np.linalg.norm(exact) < (1e-6 if interpret else 5e-5)

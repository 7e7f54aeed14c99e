"""grouped_matmul / grouped_lora against the ragged_dot reference, forward and backward.

On CPU the public functions run on XLA's ragged_dot; the custom-VJP logic used on the GPU
is checked by building it on a stand-in kernel that, like the Mosaic kernel, leaves rows
past sum(group_sizes) unwritten (here: NaN) and insists on block-aligned shapes. The
Mosaic kernel itself runs under JAX's Mosaic GPU interpreter in test_mosaic_kernel.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import (grouped_lora, grouped_lora_reference, grouped_matmul,
                                           grouped_matmul_reference, make_grouped_lora,
                                           make_grouped_matmul)
from pallas_kernels.grouped_matmul.mosaic_kernel import xla_ragged_dot

M, K, N, G = 40, 24, 16, 5
# An empty group at the start and in the middle, and 40 - 33 = 7 rows past the groups.
GROUP_SIZES = jnp.array([0, 9, 0, 17, 7], jnp.int32)


def nan_past_groups_kernel(lhs, rhs, group_sizes, *, transpose_rhs):
  out = xla_ragged_dot(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)
  rows = jnp.arange(out.shape[0])[:, None]
  return jnp.where(rows < jnp.sum(group_sizes), out, jnp.nan)


kernel_style_matmul = make_grouped_matmul(nan_past_groups_kernel)
IMPLEMENTATIONS = {"public": grouped_matmul, "kernel_style": kernel_style_matmul}


def random_inputs(seed, m=M, k=K, n=N, g=G, dtype=jnp.float32):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  lhs = jax.random.normal(k1, (m, k), dtype)
  rhs = jax.random.normal(k2, (g, k, n), dtype) / float(np.sqrt(k))
  cotangent = jax.random.normal(k3, (m, n), jnp.float32)
  return lhs, rhs, cotangent


def assert_close(actual, expected, tol):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert np.all(np.isfinite(actual))
  err = np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)
  assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_forward_matches_reference_and_zeroes_rows_past_groups(impl):
  lhs, rhs, _ = random_inputs(0)
  out = jax.jit(IMPLEMENTATIONS[impl])(lhs, rhs, GROUP_SIZES)
  assert out.shape == (M, N) and out.dtype == lhs.dtype
  assert_close(out, grouped_matmul_reference(lhs, rhs, GROUP_SIZES), 1e-5)
  np.testing.assert_array_equal(np.asarray(out[33:]), 0.0)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_gradients_match_reference(impl):
  lhs, rhs, cot = random_inputs(1)

  def loss(f):
    return lambda l, r: jnp.sum(f(l, r, GROUP_SIZES).astype(jnp.float32) * cot)

  got = jax.jit(jax.grad(loss(IMPLEMENTATIONS[impl]), argnums=(0, 1)))(lhs, rhs)
  want = jax.grad(loss(grouped_matmul_reference), argnums=(0, 1))(lhs, rhs)
  for g, w in zip(got, want):
    assert_close(g, w, 1e-5)
  np.testing.assert_array_equal(np.asarray(got[0][33:]), 0.0)  # rows past the groups
  np.testing.assert_array_equal(np.asarray(got[1])[[0, 2]], 0.0)  # empty groups


def test_bf16_matches_reference():
  lhs, rhs, cot = random_inputs(2, dtype=jnp.bfloat16)
  out = kernel_style_matmul(lhs, rhs, GROUP_SIZES)
  assert out.dtype == jnp.bfloat16
  assert_close(out, grouped_matmul_reference(lhs, rhs, GROUP_SIZES), 1e-2)
  loss = lambda f: (lambda l: jnp.sum(f(l, rhs, GROUP_SIZES).astype(jnp.float32) * cot))
  assert_close(
      jax.grad(loss(kernel_style_matmul))(lhs),
      jax.grad(loss(grouped_matmul_reference))(lhs), 1e-2)


def test_frozen_rhs_skips_weight_gradient_work():
  """With rhs not differentiated, the backward pass holds no grouped weight product."""
  lhs, rhs, cot = random_inputs(3)
  f = lambda l: jnp.sum(kernel_style_matmul(l, rhs, GROUP_SIZES) * cot)
  jaxpr = str(jax.make_jaxpr(jax.grad(f))(lhs))
  assert "ragged_dot_general" in jaxpr  # the forward and input-gradient products
  assert jaxpr.count("ragged_dot_general") == 2  # ... and no third (weight-gradient) one
  full = str(
      jax.make_jaxpr(
          jax.grad(lambda l, r: jnp.sum(kernel_style_matmul(l, r, GROUP_SIZES) * cot),
                   argnums=(0, 1)))(lhs, rhs))
  assert full.count("ragged_dot_general") == 3


@pytest.mark.parametrize("lora",
                         [grouped_lora, make_grouped_lora(kernel_style_matmul)],
                         ids=["dense_one_hot", "two_grouped_matmuls"])
def test_grouped_lora_matches_reference(lora):
  rank = 4
  k1, k2, k3, k4 = jax.random.split(jax.random.key(4), 4)
  x = jax.random.normal(k1, (M, K), jnp.float32)
  a = jax.random.normal(k2, (G, K, rank)) / float(np.sqrt(K))
  b = jax.random.normal(k3, (G, rank, N))
  cot = jax.random.normal(k4, (M, N))
  kwargs = {} if lora is grouped_lora else {"max_dense_columns": 0}
  out = jax.jit(lambda *p: lora(*p, GROUP_SIZES, 0.5, **kwargs))(x, a, b)
  assert_close(out, grouped_lora_reference(x, a, b, GROUP_SIZES, 0.5), 1e-5)
  np.testing.assert_array_equal(np.asarray(out[33:]), 0.0)

  def loss(f, **kw):
    return lambda *p: jnp.sum(f(*p[:3], GROUP_SIZES, 0.5, **kw) * cot)

  got = jax.jit(jax.grad(loss(lora, **kwargs), argnums=(0, 1, 2)))(x, a, b)
  want = jax.grad(loss(grouped_lora_reference), argnums=(0, 1, 2))(x, a, b)
  for g, w in zip(got, want):
    assert_close(g, w, 1e-5)


def test_bad_inputs_raise_clear_errors():
  lhs, rhs, _ = random_inputs(5)
  with pytest.raises(ValueError, match="group_sizes has 4 entries"):
    grouped_matmul(lhs, rhs, GROUP_SIZES[:4])
  with pytest.raises(ValueError, match="lhs has K=24"):
    grouped_matmul(lhs, rhs[:, :20], GROUP_SIZES)
  with pytest.raises(ValueError, match="rhs must have shape"):
    grouped_matmul(lhs, rhs[0], GROUP_SIZES)
  with pytest.raises(ValueError, match="integer"):
    grouped_matmul(lhs, rhs, GROUP_SIZES.astype(jnp.float32))
  a = jnp.ones((G, K, 4))
  b = jnp.ones((G, 3, N))
  with pytest.raises(ValueError, match="share G and the rank"):
    grouped_lora(lhs, a, b, GROUP_SIZES, 1.0)
  with pytest.raises(ValueError, match="x has K=24"):
    grouped_lora(lhs, a[:, :8], b[:, :4], GROUP_SIZES, 1.0)


@pytest.mark.parametrize("total", [0, 130, 255, 256])
def test_zero_rows_past_groups_rewrites_only_the_tail(total):
  from pallas_kernels.grouped_matmul.grouped_matmul import zero_rows_past_groups
  out = jax.random.normal(jax.random.key(total), (256, 3))
  sizes = jnp.array([total // 2, 0, total - total // 2], jnp.int32)
  got = np.asarray(jax.jit(zero_rows_past_groups)(out, sizes))
  np.testing.assert_array_equal(got[:total], np.asarray(out)[:total])
  np.testing.assert_array_equal(got[total:], 0.0)

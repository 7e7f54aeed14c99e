"""The Hopper kernel itself (jax's Mosaic GPU `ragged_dot_mgpu` behind mosaic_kernel.py)
on CPU, under JAX's Mosaic GPU interpreter (simulated shared memory, TMA copies,
barriers and warpgroup matmuls): the wrapper's row padding, groups that are empty,
rows past the groups and the transposed-weight input gradient, against the reference."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import grouped_matmul_reference, make_grouped_matmul
from pallas_kernels.grouped_matmul.mosaic_kernel import (BLOCK_K, BLOCK_M, BLOCK_N,
                                                         fits_mosaic_kernel, mosaic_ragged_dot)

# M not a multiple of BLOCK_M (the wrapper pads), empty first and third groups, and
# 200 - 171 = 29 rows past the groups.
M, K, N = 200, 2 * BLOCK_K, 2 * BLOCK_N
GROUP_SIZES = jnp.array([0, 95, 0, 76], jnp.int32)
mosaic_matmul = make_grouped_matmul(mosaic_ragged_dot)


def _inputs():
  k1, k2, k3 = jax.random.split(jax.random.key(11), 3)
  lhs = jax.random.normal(k1, (M, K), jnp.bfloat16)
  rhs = (jax.random.normal(k2, (4, K, N), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
  return lhs, rhs, jax.random.normal(k3, (M, N), jnp.float32)


def _rel(actual, expected):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert np.all(np.isfinite(actual))
  return np.linalg.norm(actual - expected) / np.linalg.norm(expected)


def test_interpreted_kernel_matches_reference_forward_and_input_gradient():
  lhs, rhs, cot = _inputs()
  # both directions take the kernel, not the XLA fallback
  assert M % BLOCK_M and fits_mosaic_kernel(lhs, rhs, False)
  assert fits_mosaic_kernel(cot.astype(rhs.dtype), rhs, True)
  loss = lambda f: (lambda l: jnp.sum(f(l, rhs, GROUP_SIZES).astype(jnp.float32) * cot))
  with plgpu.force_gpu_interpret_mode():
    out = jax.jit(mosaic_matmul)(lhs, rhs, GROUP_SIZES)
    dlhs = jax.jit(jax.grad(loss(mosaic_matmul)))(lhs)
  assert out.shape == (M, N) and out.dtype == jnp.bfloat16
  assert _rel(out, grouped_matmul_reference(lhs, rhs, GROUP_SIZES)) < 1e-2
  assert _rel(dlhs, jax.grad(loss(grouped_matmul_reference))(lhs)) < 1e-2
  np.testing.assert_array_equal(np.asarray(out[171:], np.float32), 0.0)
  np.testing.assert_array_equal(np.asarray(dlhs[171:], np.float32), 0.0)

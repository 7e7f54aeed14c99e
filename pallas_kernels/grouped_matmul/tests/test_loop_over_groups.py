"""The loop-over-groups grouped matmul against ragged_dot, forward and backward, and its
memory: no per-group copy of the output (what XLA:CPU makes of ragged_dot)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import grouped_lora_reference, grouped_matmul_reference
from pallas_kernels.grouped_matmul.loop_over_groups import (loop_grouped_lora, loop_grouped_matmul)

M, K, N, G = 40, 24, 16, 5
# An empty group at the start and in the middle, and 40 - 33 = 7 rows past the groups.
GROUP_SIZES = jnp.array([0, 9, 0, 17, 7], jnp.int32)


def random_inputs(seed, dtype=jnp.float32):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  lhs = jax.random.normal(k1, (M, K), dtype)
  rhs = jax.random.normal(k2, (G, K, N), dtype) / float(np.sqrt(K))
  return lhs, rhs, jax.random.normal(k3, (M, N), jnp.float32)


def assert_close(actual, expected, tol):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  err = np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)
  assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"


def test_forward_matches_ragged_dot_and_zeroes_rows_past_groups():
  lhs, rhs, _ = random_inputs(0)
  out = jax.jit(loop_grouped_matmul)(lhs, rhs, GROUP_SIZES)
  assert out.shape == (M, N) and out.dtype == lhs.dtype
  assert_close(out, grouped_matmul_reference(lhs, rhs, GROUP_SIZES), 1e-6)
  np.testing.assert_array_equal(np.asarray(out[33:]), 0.0)


@pytest.mark.parametrize("argnums", [(0,), (0, 1)])
def test_gradients_match_ragged_dot(argnums):
  lhs, rhs, cot = random_inputs(1)

  def loss(f):
    return lambda l, r: jnp.sum(f(l, r, GROUP_SIZES).astype(jnp.float32) * cot)

  got = jax.jit(jax.grad(loss(loop_grouped_matmul), argnums=argnums))(lhs, rhs)
  want = jax.grad(loss(grouped_matmul_reference), argnums=argnums)(lhs, rhs)
  for g, w in zip(got, want):
    assert_close(g, w, 1e-6)
  np.testing.assert_array_equal(np.asarray(got[0][33:]), 0.0)
  if len(argnums) == 2:
    np.testing.assert_array_equal(np.asarray(got[1])[[0, 2]], 0.0)  # empty groups


def test_bf16_matches_ragged_dot():
  lhs, rhs, cot = random_inputs(2, jnp.bfloat16)
  out = loop_grouped_matmul(lhs, rhs, GROUP_SIZES)
  assert out.dtype == jnp.bfloat16
  assert_close(out, grouped_matmul_reference(lhs, rhs, GROUP_SIZES), 1e-2)


def test_grouped_lora_matches_reference_with_gradients():
  lhs, _, cot = random_inputs(3)
  ka, kb = jax.random.split(jax.random.key(4))
  a = jax.random.normal(ka, (G, K, 4)) / float(np.sqrt(K))
  b = jax.random.normal(kb, (G, 4, N))

  def loss(f, **kw):
    return lambda x, a, b: jnp.sum(f(x, a, b, GROUP_SIZES, 2.0, **kw) * cot)

  want = jax.grad(loss(grouped_lora_reference), argnums=(0, 1, 2))(lhs, a, b)
  # dense path (G * r small, as for the target) and the grouped-matmul path
  for kw in ({}, {"max_dense_columns": 0}):
    got = jax.grad(loss(loop_grouped_lora, **kw), argnums=(0, 1, 2))(lhs, a, b)
    for g, w in zip(got, want):
      assert_close(g, w, 1e-5)


def test_compiled_memory_holds_no_per_group_copies():
  m, k, n, g = 4096, 256, 512, 16
  lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((g,), jnp.int32)

  def step(f):
    return jax.grad(lambda l, r, s: jnp.sum(f(l, r, s).astype(jnp.float32)))

  temp = jax.jit(step(loop_grouped_matmul)).lower(lhs, rhs, sizes).compile()
  per_group_output = g * m * n * 4  # XLA:CPU's ragged_dot keeps [G, M, N] fp32
  assert temp.memory_analysis().temp_size_in_bytes < per_group_output / 4


def test_row_blocked_weight_gradient_matches_one_product():
  from pallas_kernels.grouped_matmul.loop_over_groups import row_blocked_weight_gradient
  lhs, _, cot = random_inputs(5)
  mask = jnp.arange(M) % 3 != 0
  want = jnp.where(mask[:, None], lhs, 0).T @ cot
  for block in (7, 16, 40, 64):  # with and without a padded last block
    assert_close(row_blocked_weight_gradient(lhs, cot, mask, block=block), want, 1e-6)


def test_grouped_lora_backward_holds_no_fp32_copy_of_the_rows():
  m, k, n, g, r = 65536, 256, 128, 8, 4  # 8 blocks of rows
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  a = jax.ShapeDtypeStruct((g, k, r), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((g, r, n), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((g,), jnp.int32)

  def step(x, a, b, s):
    return jax.grad(lambda x, a, b: jnp.sum(loop_grouped_lora(x, a, b, s, 2.0).astype(jnp.float32)),
                    argnums=(0, 1, 2))(x, a, b)

  temp = jax.jit(step).lower(x, a, b, sizes).compile().memory_analysis().temp_size_in_bytes
  assert temp < m * k * 4  # below one fp32 copy of x

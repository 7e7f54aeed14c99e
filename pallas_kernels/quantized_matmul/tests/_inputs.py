"""Fresh random packed weights for the quantized-matmul tests, drawn so that every code
of the format occurs, and the checks they are compared with."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quantized_matmul import formats

# An odd number of groups, empty ones first, in the middle and last, and 77 - 71 = 6
# rows past the groups; 77 rows is no multiple of the row tile.
M = 77
GROUP_SIZES = np.array([0, 19, 0, 40, 12, 0, 0], np.int32)
ROWS_IN_GROUPS = int(GROUP_SIZES.sum())
# fp8 shapes are no multiple of the tiles nor of its 128 x 128 scale blocks.
SHAPES = {"fp8_block": (200, 272), "mxfp4": (48, 96), "int4": (48, 96)}
X_SCALE = 2.0**-12  # |x| < 2^-10: products with the largest mxfp4 weights stay finite


def _finite_fp8_bits():
  bits = np.arange(256, dtype=np.uint8)
  return bits[(bits & 0x7F) != 0x7F]  # 0x7F and 0xFF are e4m3fn's NaNs


def _covering(rng, pool, size):
  """`size` draws from `pool`, shuffled, holding every element of it at least once when
    there is room."""
  if size < len(pool):
    return rng.choice(pool, size)
  return rng.permutation(np.concatenate([pool, rng.choice(pool, size - len(pool))]))


def packed_weights(seed, fmt_name, g, n, k):
  """codes, scales [g, n, ...] of `fmt_name` in which every code (every nibble in both
    halves of a byte; every finite fp8 pattern) occurs, and for mxfp4 every scale
    exponent 1..254."""
  fmt = formats.get(fmt_name)
  rng = np.random.default_rng(seed)
  codes_shape = (g, *fmt.codes_shape(n, k))
  scales_shape = (g, *fmt.scales_shape(n, k))
  size = int(np.prod(codes_shape))
  if fmt_name == "fp8_block":
    codes = _covering(rng, _finite_fp8_bits(), size).reshape(codes_shape)
    codes = jax.lax.bitcast_convert_type(jnp.asarray(codes), jnp.float8_e4m3fn)
    # magnitudes up to 448: scales well below 1 keep the weights O(1)
    scales = jnp.asarray(rng.uniform(1e-4, 4e-3, scales_shape), jnp.float32)
    return codes, scales
  codes = rng.integers(0, 256, codes_shape, dtype=np.uint8)
  if fmt_name == "mxfp4":
    exponents = np.arange(1, 255, dtype=np.uint8)
    scales = _covering(rng, exponents, int(np.prod(scales_shape))).reshape(scales_shape)
    # Under the two largest exponents only magnitudes up to 1.5 (codes 0-3 and 8-11), so
    # that every weight is finite: 6 * 2^127 is not.
    large = np.repeat(scales >= 253, fmt.block[1] // 2, axis=-1)
    codes = np.where(large, codes & 0xBB, codes)
    return jnp.asarray(codes), jnp.asarray(scales, jnp.uint8)
  signs = rng.choice([-1.0, 1.0], scales_shape)
  return jnp.asarray(codes), jnp.asarray(signs * rng.lognormal(-3.0, 1.0, scales_shape),
                                         jnp.bfloat16)


def activations(seed, m, k):
  x = jax.random.normal(jax.random.key(seed), (m, k), jnp.float32)
  return (jnp.clip(x, -3.9, 3.9) * X_SCALE).astype(jnp.bfloat16)


def assert_codes_covered(codes, fmt_name):
  bits = np.asarray(jax.lax.bitcast_convert_type(codes, jnp.uint8)).ravel()
  if fmt_name == "fp8_block":
    assert set(bits.tolist()) == set(_finite_fp8_bits().tolist())
  else:
    assert set((bits & 0xF).tolist()) == set(range(16))
    assert set((bits >> 4).tolist()) == set(range(16))


def product_bound(x, w, group_sizes, transpose=False):
  """|x_g| @ |W_g|^T per group (|x_g| @ |W_g| when transpose) in float64, rows past the
    groups 0: every accumulation and rounding error of an output is a small part of it."""
  x = np.abs(np.asarray(x, np.float64))
  w = np.abs(np.asarray(w, np.float64))
  out = np.zeros((x.shape[0], w.shape[2] if transpose else w.shape[1]))
  start = 0
  for g, size in enumerate(np.asarray(group_sizes)):
    out[start:start + size] = x[start:start + size] @ (w[g] if transpose else w[g].T)
    start += size
  return out


def assert_close_to_reference(actual, expected, bound, rows_in_groups):
  """Within 1% of |x| @ |W| per element (bf16 rounding of the output and the fp32
    accumulation order are far below), rows past the groups exactly 0."""
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  assert np.all(np.isfinite(actual[:rows_in_groups])) and np.all(np.isfinite(expected))
  err = np.abs(actual - expected)[:rows_in_groups]
  worst = np.max(err - 1e-2 * bound[:rows_in_groups])
  assert worst <= 1e-37, f"error exceeds 1% of |x| @ |W| by {worst:.3e}"
  rel = np.linalg.norm(err) / max(np.linalg.norm(expected[:rows_in_groups]), 1e-37)
  assert rel < 1e-2, f"relative error {rel:.2e}"
  np.testing.assert_array_equal(actual[rows_in_groups:], 0.0)

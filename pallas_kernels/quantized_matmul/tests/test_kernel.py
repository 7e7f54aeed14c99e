"""The Pallas Triton kernels, interpreted on CPU, against the dequantize-then-bf16
reference: every code and scale decoded inside a tile bit for bit as formats.dequantize
does, then the forward and the input gradient on awkward shapes (odd and empty groups,
rows past the groups, M, N and K no multiples of the tiles) for every format."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.quantized_matmul import formats
from pallas_kernels.quantized_matmul.kernel import (TileConfig, dequantized_tile,
                                                    quantized_grouped_matmul_kernel, row_tiles)
from pallas_kernels.quantized_matmul.tests._inputs import (GROUP_SIZES, M, ROWS_IN_GROUPS, SHAPES,
                                                           activations, assert_close_to_reference,
                                                           assert_codes_covered, packed_weights,
                                                           product_bound)

SMALL = TileConfig(bm=16, bn=32, bk=64, num_warps=4, num_stages=1)
# fp8 tiles spanning 2 x 2 scale blocks (the scale tile is spread, not one scalar)
WIDE = TileConfig(bm=16, bn=256, bk=256, num_warps=4, num_stages=1)


def _dequantize_in_kernel(codes, scales, fmt_name, bn, bk):
  """A whole [N, K] matrix through `dequantized_tile`, one [bn, bk] tile per program."""
  fmt = formats.get(fmt_name)
  n, k = codes.shape[0], codes.shape[1] * fmt.per_code

  def kernel(codes_ref, scales_ref, out_ref):
    i, j = pl.program_id(0), pl.program_id(1)
    tile = dequantized_tile(codes_ref, scales_ref, jnp.int32(0), i * bn, j * bk, fmt=fmt, bn=bn,
                            bk=bk, n=n, k=k)
    out_ref[pl.ds(i * bn, bn), pl.ds(j * bk, bk)] = tile

  grid = (pl.cdiv(n, bn), pl.cdiv(k, bk))
  # whole tiles (edge tiles hold zeros past [n, k]), cut to [n, k]
  padded = jax.ShapeDtypeStruct((grid[0] * bn, grid[1] * bk), jnp.bfloat16)
  out = pl.pallas_call(kernel, grid=grid, out_shape=padded, interpret=True)(codes[None],
                                                                            scales[None])
  return out[:n, :k]


def _bits(x):
  return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))


def test_every_mxfp4_nibble_and_e8m0_exponent_decodes_as_formats_does():
  # every nibble, in both halves of a byte, under every exponent 0..255: row r holds the
  # bytes 0x00, 0x11, ..., 0xFF under exponent r and again under exponent 255 - r, NaN
  # (255) and the subnormal 2^-127 (0) included
  exponents = np.arange(256, dtype=np.uint8)
  scales = jnp.asarray(np.stack([exponents, exponents[::-1]], axis=1))
  codes = jnp.asarray(np.tile(np.arange(16, dtype=np.uint8) * 0x11, (256, 2)))
  got = _dequantize_in_kernel(codes, scales, "mxfp4", 16, 64)
  np.testing.assert_array_equal(_bits(got), _bits(formats.dequantize(codes, scales, "mxfp4")))
  value = formats.e8m0_values(jnp.array([0, 1, 127, 254, 255], jnp.uint8))
  assert value[0] == 2.0**-127 and value[1] == 2.0**-126 and value[2] == 1.0
  assert value[3] == 2.0**127 and np.isnan(value[4])


@pytest.mark.parametrize("fmt_name", ["int4", "fp8_block"])
def test_every_code_decodes_as_formats_does(fmt_name):
  n, k = (64, 256) if fmt_name == "int4" else (300, 272)
  codes, scales = packed_weights(3, fmt_name, 1, n, k)
  codes, scales = codes[0], scales[0]
  assert_codes_covered(codes, fmt_name)
  want = _bits(formats.dequantize(codes, scales, fmt_name))
  for bn, bk in ((32, 64), (256, 256)) if fmt_name == "fp8_block" else ((32, 64),):
    np.testing.assert_array_equal(_bits(_dequantize_in_kernel(codes, scales, fmt_name, bn, bk)),
                                  want)


def test_row_tiles_cover_every_row_once():
  rng = np.random.default_rng(0)
  for m, bm in ((77, 16), (128, 32), (5, 16)):
    for _ in range(5):
      sizes = rng.multinomial(m - rng.integers(0, 3), np.ones(6) / 6).astype(np.int32)
      segment, tile, first, end = map(
          np.asarray,
          jax.jit(row_tiles, static_argnums=(1, 2))(jnp.asarray(sizes), m, bm))
      owner = np.full(m, -1)
      bounds = np.concatenate([[0], np.cumsum(sizes)])
      for s, t, a, b in zip(segment, tile, first, end):
        assert a == b or t * bm <= a < b <= t * bm + bm
        assert np.all(owner[a:b] == -1)  # no row twice
        owner[a:b] = s
        if a < b and s < len(sizes):
          assert bounds[s] <= a and b <= bounds[s + 1]
      np.testing.assert_array_equal(owner, np.searchsorted(bounds[1:], np.arange(m), "right"))


@pytest.mark.parametrize("fmt_name", ["fp8_block", "mxfp4", "int4"])
def test_forward_and_input_gradient_match_reference(fmt_name):
  n, k = SHAPES[fmt_name]
  g = len(GROUP_SIZES)
  codes, scales = packed_weights(10, fmt_name, g, n, k)
  assert_codes_covered(codes, fmt_name)
  if fmt_name == "mxfp4":
    assert set(np.asarray(scales).ravel().tolist()) == set(range(1, 255))
  x = activations(11, M, k)
  dout = activations(12, M, n)
  sizes = jnp.asarray(GROUP_SIZES)
  w = formats.dequantize(codes, scales, fmt_name)
  run = functools.partial(quantized_grouped_matmul_kernel, fmt=fmt_name, interpret=True)
  configs = [SMALL] + ([WIDE] if fmt_name == "fp8_block" else [])
  for config in configs:
    out = run(x, codes, scales, sizes, transpose=False, config=config)
    assert out.shape == (M, n) and out.dtype == jnp.bfloat16
    assert_close_to_reference(out, jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), sizes),
                              product_bound(x, w, GROUP_SIZES), ROWS_IN_GROUPS)
    dx = run(dout, codes, scales, sizes, transpose=True, config=config)
    assert dx.shape == (M, k) and dx.dtype == jnp.bfloat16
    assert_close_to_reference(dx, jax.lax.ragged_dot(dout, w, sizes),
                              product_bound(dout, w, GROUP_SIZES, transpose=True), ROWS_IN_GROUPS)


def test_tile_config_rejects_bad_tiles():
  with pytest.raises(ValueError, match="power of two"):
    TileConfig(bm=48).check(formats.get("int4"))
  with pytest.raises(ValueError, match="bk >= 32"):
    TileConfig(bk=16).check(formats.get("mxfp4"))


@pytest.mark.parametrize("fmt_name", ["fp8_block", "mxfp4", "int4"])
def test_kernels_lower_to_triton_for_hopper(fmt_name):
  """Both orientations, the default tiles and wide ones, lowered ahead of time for an H200
  (an abstract device: no GPU needed): every operation has a Triton lowering."""
  from jax.sharding import AbstractDevice, AbstractMesh
  h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  fmt = formats.get(fmt_name)
  g, m = 3, 1000
  n, k = (576, 7168) if fmt_name == "fp8_block" else (512, 384)
  codes = jax.ShapeDtypeStruct((g, *fmt.codes_shape(n, k)), fmt.codes_dtype)
  scales = jax.ShapeDtypeStruct((g, *fmt.scales_shape(n, k)), fmt.scales_dtype)
  sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
  for transpose in (False, True):
    x = jax.ShapeDtypeStruct((m, n if transpose else k), jnp.bfloat16)
    for config in (None, TileConfig(bm=128, bn=256, bk=256, num_warps=8, num_stages=3)):
      run = functools.partial(quantized_grouped_matmul_kernel, fmt=fmt_name, transpose=transpose,
                              config=config)
      with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h200)):
        lowered = jax.jit(run).trace(x, codes, scales, sizes).lower(lowering_platforms=("cuda",))
      assert "__gpu$xla.gpu.triton" in lowered.as_text()

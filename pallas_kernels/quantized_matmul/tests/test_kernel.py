"""The Pallas Triton kernels, interpreted on CPU, against the dequantize-then-bf16
reference: every code and scale decoded inside a tile bit for bit as formats.dequantize
does, then the forward and the input gradient on awkward shapes (odd and empty groups,
rows past the groups, M, N and K no multiples of the tiles) for every format."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.quantized_matmul import formats
from pallas_kernels.quantized_matmul.kernel import (MXFP4_EXACT_EXPONENTS, TileConfig,
                                                    groups_needing_f32,
                                                    quantized_grouped_matmul_kernel, row_tiles,
                                                    weight_tiles)
from pallas_kernels.quantized_matmul.tests._inputs import (GROUP_SIZES, M, ROWS_IN_GROUPS, SHAPES,
                                                           activations, assert_close_to_reference,
                                                           assert_codes_covered, packed_weights,
                                                           product_bound)

SMALL = TileConfig(bm=16, bn=32, bk=64, num_warps=4, num_stages=1)
# 4-bit: even and odd inputs as two products, scales loaded one per element
SMALL_HALVES = dataclasses.replace(SMALL, halves=True, gather_scales=True)
# fp8 tiles spanning 2 x 2 scale blocks (the scale tile is spread, not one scalar)
WIDE = TileConfig(bm=16, bn=256, bk=256, num_warps=4, num_stages=1)
# every way a 4-bit tile is decoded
PACKED_TILE_VARIANTS = [
    dataclasses.replace(SMALL, dequant=dequant, halves=halves, gather_scales=gather)
    for dequant in ("bits", "f32")
    for halves in (False, True)
    for gather in (False, True)
]


def _dequantize_in_kernel(codes, scales, fmt_name, cfg, dequant):
  """A whole [N, K] matrix through `weight_tiles`, one [bn, bk] tile per program: halves
    put back in order, a tile's scalar scale (fp8_block "bits") multiplied in float32."""
  fmt = formats.get(fmt_name)
  n, k = codes.shape[0], codes.shape[1] * fmt.per_code
  bn, bk = cfg.bn, cfg.bk

  def kernel(codes_ref, scales_ref, out_ref):
    i, j = pl.program_id(0), pl.program_id(1)
    tiles, scale = weight_tiles(codes_ref, scales_ref, jnp.int32(0), i * bn, j * bk, fmt=fmt,
                                cfg=cfg, n=n, k=k, dequant=dequant)
    if scale is not None:
      tiles = [(t.astype(jnp.float32) * scale).astype(jnp.bfloat16) for t in tiles]
    width = bk // len(tiles)
    for h, tile in enumerate(tiles):
      out_ref[pl.ds(i * bn, bn), pl.ds(j * bk + h * width, width)] = tile

  grid = (pl.cdiv(n, bn), pl.cdiv(k, bk))
  # whole tiles (edge tiles hold zeros past [n, k]), cut to [n, k]
  padded = jax.ShapeDtypeStruct((grid[0] * bn, grid[1] * bk), jnp.bfloat16)
  out = pl.pallas_call(kernel, grid=grid, out_shape=padded, interpret=True)(codes[None],
                                                                            scales[None])
  if cfg.halves:  # per tile [even columns | odd columns] -> interleaved
    out = out.reshape(out.shape[0], grid[1], 2, bk // 2).swapaxes(2, 3).reshape(out.shape)
  return out[:n, :k]


def _bits(x):
  return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))


def _every_mxfp4_code(exponents):
  """codes, scales: every nibble in both halves of a byte under each exponent, twice: row r
    holds the bytes 0x00, 0x11, ..., 0xFF under exponents[r] and under exponents[-1 - r]."""
  scales = jnp.asarray(np.stack([exponents, exponents[::-1]], axis=1))
  codes = jnp.asarray(np.tile(np.arange(16, dtype=np.uint8) * 0x11, (len(exponents), 2)))
  return codes, scales


def test_every_mxfp4_nibble_and_e8m0_exponent_decodes_as_formats_does():
  # the float32 path under every exponent 0..255, NaN (255) and the subnormal 2^-127 (0)
  # included; the integer path under the exponents it is used for
  lo, hi = MXFP4_EXACT_EXPONENTS
  for dequant, exponents in (("f32", np.arange(256)), ("bits", np.arange(lo, hi + 1))):
    codes, scales = _every_mxfp4_code(exponents.astype(np.uint8))
    want = _bits(formats.dequantize(codes, scales, "mxfp4"))
    for cfg in (SMALL, SMALL_HALVES):
      got = _dequantize_in_kernel(codes, scales, "mxfp4", cfg, dequant)
      np.testing.assert_array_equal(_bits(got), want, err_msg=f"{dequant} {cfg.name}")
  value = formats.e8m0_values(jnp.array([0, 1, 127, 254, 255], jnp.uint8))
  assert value[0] == 2.0**-127 and value[1] == 2.0**-126 and value[2] == 1.0
  assert value[3] == 2.0**127 and np.isnan(value[4])


def test_mxfp4_groups_with_edge_exponents_take_the_float32_path():
  codes, scales = _every_mxfp4_code(np.arange(256).astype(np.uint8))
  fmt = formats.get("mxfp4")
  stacked = jnp.stack(
      [jnp.clip(scales, 2, 252), scales,
       jnp.clip(scales, 1, 252),
       jnp.clip(scales, 2, 253)]).astype(jnp.uint8)
  np.testing.assert_array_equal(groups_needing_f32(stacked, fmt), [0, 1, 1, 1, 0])
  # through the kernel: a group of NaN exponents (255) under code 1 gives NaN rows, which
  # the integer path would not (it would build the finite 2^127)
  n, k = 32, 64
  nan_group = (jnp.full((n, k // 2), 0x11, jnp.uint8), jnp.full((n, k // 32), 255, jnp.uint8))
  normal_codes, normal_scales = packed_weights(5, "mxfp4", 1, n, k)
  normal_scales = jnp.clip(normal_scales, 2, 252).astype(jnp.uint8)
  codes = jnp.stack([nan_group[0], normal_codes[0]])
  scales = jnp.stack([nan_group[1], normal_scales[0]])
  x = activations(6, 32, k)
  sizes = jnp.array([8, 24], jnp.int32)
  out = np.asarray(
      quantized_grouped_matmul_kernel(x, codes, scales, sizes, fmt="mxfp4", transpose=False,
                                      config=SMALL, interpret=True), np.float32)
  assert np.all(np.isnan(out[:8]))
  w = np.asarray(formats.dequantize(normal_codes[0], normal_scales[0], "mxfp4"), np.float64)
  want = np.asarray(x[8:], np.float64) @ w.T
  assert_close_to_reference(out[8:], want, np.abs(np.asarray(x[8:], np.float64)) @ np.abs(w).T, 24)


@pytest.mark.parametrize("fmt_name", ["int4", "fp8_block"])
def test_every_code_decodes_as_formats_does(fmt_name):
  n, k = (64, 256) if fmt_name == "int4" else (300, 272)
  codes, scales = packed_weights(3, fmt_name, 1, n, k)
  codes, scales = codes[0], scales[0]
  assert_codes_covered(codes, fmt_name)
  want = _bits(formats.dequantize(codes, scales, fmt_name))
  if fmt_name == "int4":
    cases = [(cfg, cfg.dequant) for cfg in PACKED_TILE_VARIANTS]
  else:  # a tile inside one scale block (scaled after the product on "bits"), and one across
    cases = [(cfg, d) for cfg in (SMALL, WIDE) for d in ("bits", "f32")]
  for cfg, dequant in cases:
    got = _dequantize_in_kernel(codes, scales, fmt_name, cfg, dequant)
    np.testing.assert_array_equal(_bits(got), want, err_msg=f"{dequant} {cfg.name}")


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
  # (the "f32" decode of every format is checked tile by tile above, and through the kernel
  # on the mxfp4 groups that take it)
  configs = [SMALL, WIDE if fmt_name == "fp8_block" else SMALL_HALVES]
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
  """Both orientations, the default tiles and wide ones in every variant, lowered ahead of
  time for an H200 (an abstract device: no GPU needed): every operation has a Triton
  lowering."""
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
    wide = TileConfig(bm=128, bn=256, bk=256, num_warps=8, num_stages=3)
    configs = [None, wide, dataclasses.replace(wide, dequant="f32")]
    if fmt.per_code > 1:
      configs += [
          dataclasses.replace(wide, halves=True),
          dataclasses.replace(wide, halves=True, gather_scales=True),
          dataclasses.replace(wide, gather_scales=True)
      ]
    else:  # tiles inside one scale block: scaled after the product, or per element
      configs += [TileConfig(128, 128, 128, 8, 3, dequant=d) for d in ("bits", "f32")]
    for config in configs:
      run = functools.partial(quantized_grouped_matmul_kernel, fmt=fmt_name, transpose=transpose,
                              config=config)
      with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h200)):
        lowered = jax.jit(run).trace(x, codes, scales, sizes).lower(lowering_platforms=("cuda",))
      assert "__gpu$xla.gpu.triton" in lowered.as_text()

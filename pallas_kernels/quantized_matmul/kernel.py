"""Grouped matmuls against packed weights, dequantized tile by tile: a Pallas (Triton
backend) kernel family.

    forward         x [M, K] (rows sorted by group) -> [M, N],  row i = x[i] @ W[g(i)]^T
    input gradient  x [M, N]                         -> [M, K],  row i = x[i] @ W[g(i)]

W[g] [N, K] is the weight that codes[g] and scales[g] stand for (formats.py). No bf16 copy
of a weight exists in memory: each program loads one [bn, bk] tile of packed codes and
its scales per step of the contraction, dequantizes it in float32 and rounds it to bf16
once (what formats.dequantize computes), then multiplies it into a float32 accumulator on
the tensor cores. Both orientations read the same [N, K] tiles; the forward contracts
their K axis, the input gradient their N axis.

Grouping runs over rows: `row_tiles` lists (segment, row tile, first row, end row) for
every row tile each segment touches, the segments being the G groups and one more for
the rows past sum(group_sizes), whose outputs are written as zeros. There are at most
ceil(M / bm) + G such entries (a tile crossing a group boundary appears once per group),
so the grid is static; unused entries do nothing. Programs write only their own rows of a
tile (masked stores), so tiles shared by two groups are written without races.

Tile sizes, warps and pipeline stages are `TileConfig`s, one per orientation
(`FORWARD`, `INPUT_GRADIENT`); the benchmark's sweep tunes them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import formats

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Tiles of one orientation: bm rows of x; bn rows and bk columns of the [N, K] weight
  tile (forward: bn output columns, bk contracted; input gradient: bn contracted, bk output
  columns); num_warps and num_stages (software pipelining of the contraction loop)."""
  bm: int = 128
  bn: int = 128
  bk: int = 64
  num_warps: int = 8
  num_stages: int = 4

  def check(self, fmt: formats.Format) -> None:
    for name in ("bm", "bn", "bk"):
      size = getattr(self, name)
      if size < 16 or size & (size - 1):
        raise ValueError(f"tile {name}={size} must be a power of two >= 16")
    if fmt.per_code > 1 and self.bk < fmt.block[1]:
      raise ValueError(f"{fmt.name} needs bk >= {fmt.block[1]} (one scale per "
                       f"{fmt.block[1]} inputs), got bk={self.bk}")


FORWARD = TileConfig(bm=128, bn=128, bk=64, num_warps=8, num_stages=4)
INPUT_GRADIENT = TileConfig(bm=128, bn=64, bk=128, num_warps=8, num_stages=4)

# ---- the row-tile list -----------------------------------------------------------------


def num_row_tiles(m: int, num_groups: int, bm: int) -> int:
  """Static length of the row-tile list: ceil(m / bm) tiles plus one per segment boundary."""
  return -(-m // bm) + num_groups


def row_tiles(group_sizes: jax.Array, m: int, bm: int):
  """(segment, row tile, first row, end row) int32 [T] each, T = num_row_tiles(m, G, bm).

    Segment g < G is group g, segment G the rows past sum(group_sizes) (clamped to m).
    Entry t covers rows [first, end) of row tile `tile` (rows tile * bm ...); entries past
    the last used one have first == end.
    """
  g = group_sizes.shape[0]
  ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
  ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  nonempty = ends > starts
  first_tile = starts // bm
  counts = jnp.where(nonempty, (ends - 1) // bm - first_tile + 1, 0)
  offsets_end = jnp.cumsum(counts)
  total = num_row_tiles(m, g, bm)
  t = jnp.arange(total, dtype=jnp.int32)
  segment = jnp.minimum(jnp.searchsorted(offsets_end, t, side="right"), g).astype(jnp.int32)
  tile = first_tile[segment] + t - (offsets_end[segment] - counts[segment])
  used = t < offsets_end[-1]
  first = jnp.where(used, jnp.maximum(starts[segment], tile * bm), 0)
  end = jnp.where(used, jnp.minimum(ends[segment], tile * bm + bm), 0)
  return segment, jnp.where(used, tile, 0), first, end


# ---- in-tile dequantization ------------------------------------------------------------


def _iota(n):
  return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _e2m1_from_bits(nibbles):
  """int32 nibbles -> float32 e2m1 values, built as float32 bit patterns: magnitude code
    c = (exponent e, mantissa m) >= 2 is 2^(e-1) * (1 + m/2), i.e. exponent field e + 126 and
    mantissa m; code 1 is 0.5; the sign is bit 3."""
  magnitude = nibbles & 7
  normal = (magnitude << 22) + (126 << 23)
  bits = jnp.where(magnitude >= 2, normal, jnp.where(magnitude == 1, 126 << 23, 0))
  return jax.lax.bitcast_convert_type(bits | ((nibbles & 8) << 28), F32)


def _e8m0_from_bits(exponents):
  """int32 e8m0 exponents -> float32 2^(s-127) (formats.e8m0_values)."""
  bits = jnp.where(exponents == 0, 0x00400000,
                   jnp.where(exponents == 255, 0x7FC00000, exponents << 23))
  return jax.lax.bitcast_convert_type(bits, F32)


def _unpack(codes):
  """uint8 [bn, bk/2] -> int32 nibbles [bn, bk], the low nibble first."""
  c = codes.astype(jnp.int32)
  pairs = jnp.stack([c & 0xF, c >> 4], axis=-1)
  return pairs.reshape(codes.shape[0], 2 * codes.shape[1])


def _spread_columns(x, width):
  """[r, c] -> [r, c * width], each column repeated `width` times (no reordering)."""
  r, c = x.shape
  return jnp.broadcast_to(x[:, :, None], (r, c, width)).reshape(r, c * width)


def _spread_rows(x, height):
  """[r, c] -> [r * height, c], each row repeated `height` times (no reordering)."""
  r, c = x.shape
  return jnp.broadcast_to(x[:, None, :], (r, height, c)).reshape(r * height, c)


def dequantized_tile(codes_ref, scales_ref, g, n0, k0, *, fmt, bn, bk, n, k):
  """Dequantized bf16 [bn, bk] tile of W[g] at (n0, k0); zero outside [n, k]."""
  rows = n0 + _iota(bn)
  row_ok = (rows < n)[:, None]
  if fmt.per_code == 1:  # fp8_block: one float32 scale per 128 x 128 block
    cols = k0 + _iota(bk)
    ok = row_ok & (cols < k)[None, :]
    # Triton has no fill value of fp8 type: lanes outside the matrix are zeroed as float32
    codes = plgpu.load(codes_ref.at[g, pl.ds(n0, bn), pl.ds(k0, bk)], mask=ok)
    values = jnp.where(ok, codes.astype(F32), 0.0)
    br, bc = fmt.block
    if bn <= br and bk <= bc:  # the tile lies inside one scale block
      scale = scales_ref[g, n0 // br, k0 // bc]
      return (values * scale).astype(jnp.bfloat16)
    sr, sc = max(bn // br, 1), max(bk // bc, 1)
    srows = n0 // br + _iota(sr)
    scols = k0 // bc + _iota(sc)
    sok = (srows < scales_ref.shape[1])[:, None] & (scols < scales_ref.shape[2])[None, :]
    block = plgpu.load(scales_ref.at[g, pl.ds(n0 // br, sr),
                                     pl.ds(k0 // bc, sc)], mask=sok, other=0.0)
    block = _spread_rows(block, bn // sr) if sr > 1 else jnp.broadcast_to(block, (bn, sc))
    scale = _spread_columns(block, bk // sc) if sc > 1 else jnp.broadcast_to(block, (bn, bk))
    return (values * scale).astype(jnp.bfloat16)
  # 4-bit: two codes per byte along K, one scale per (row, 32 inputs)
  half, per_scale = bk // 2, fmt.block[1]
  pcols = k0 // 2 + _iota(half)
  codes = plgpu.load(codes_ref.at[g, pl.ds(n0, bn), pl.ds(k0 // 2, half)],
                     mask=row_ok & (pcols < k // 2)[None, :], other=0)
  nibbles = _unpack(codes)
  ns = bk // per_scale
  scols = k0 // per_scale + _iota(ns)
  raw = plgpu.load(scales_ref.at[g, pl.ds(n0, bn), pl.ds(k0 // per_scale, ns)],
                   mask=row_ok & (scols < k // per_scale)[None, :], other=0)
  if fmt.name == "mxfp4":
    values, scale = _e2m1_from_bits(nibbles), _e8m0_from_bits(raw.astype(jnp.int32))
  else:
    values, scale = (nibbles - 8).astype(F32), raw.astype(F32)
  return (values * _spread_columns(scale, per_scale)).astype(jnp.bfloat16)


# ---- the kernel ------------------------------------------------------------------------


def _kernel(segment_ref, tile_ref, first_ref, end_ref, x_ref, codes_ref, scales_ref, out_ref, *,
            fmt, transpose, cfg, n, k, num_groups):
  """One program: output columns program_id(0), row-tile entry program_id(1)."""
  col_tile, entry = pl.program_id(0), pl.program_id(1)
  g, first, end = segment_ref[entry], first_ref[entry], end_ref[entry]
  row0 = tile_ref[entry] * cfg.bm
  rows = row0 + _iota(cfg.bm)
  row_ok = ((rows >= first) & (rows < end))[:, None]
  # forward: out columns along N (bn), contraction along K (bk); input gradient: swapped
  out_width, out_size = (cfg.bk, k) if transpose else (cfg.bn, n)
  step, depth = (cfg.bn, n) if transpose else (cfg.bk, k)
  c0 = col_tile * out_width
  out_cols = c0 + _iota(out_width)
  out_at = out_ref.at[pl.ds(row0, cfg.bm), pl.ds(c0, out_width)]
  store_ok = row_ok & (out_cols < out_size)[None, :]

  @pl.when((end > first) & (g == num_groups))
  def _rows_past_groups():
    plgpu.store(out_at, jnp.zeros((cfg.bm, out_width), out_ref.dtype), mask=store_ok)

  @pl.when((end > first) & (g < num_groups))
  def _product():

    def body(i, acc):
      d0 = i * step
      depth_ok = (d0 + _iota(step) < depth)[None, :]
      x = plgpu.load(x_ref.at[pl.ds(row0, cfg.bm), pl.ds(d0, step)], mask=row_ok & depth_ok,
                     other=0).astype(jnp.bfloat16)
      tile = functools.partial(dequantized_tile, codes_ref, scales_ref, g, fmt=fmt, bn=cfg.bn,
                               bk=cfg.bk, n=n, k=k)
      if transpose:  # x [bm, bn] @ W[bn, bk]
        w = tile(d0, c0)
        dims = (((1,), (0,)), ((), ()))
      else:  # x [bm, bk] @ W[bn, bk]^T
        w = tile(c0, d0)
        dims = (((1,), (1,)), ((), ()))
      return acc + jax.lax.dot_general(x, w, (dims), preferred_element_type=F32)

    acc = jax.lax.fori_loop(0, pl.cdiv(depth, step), body, jnp.zeros((cfg.bm, out_width), F32))
    plgpu.store(out_at, acc.astype(out_ref.dtype), mask=store_ok)


def quantized_grouped_matmul_kernel(x, codes, scales, group_sizes, *, fmt: str, transpose: bool,
                                    config: TileConfig | None = None, interpret: bool = False):
  """x [M, K] -> [M, N] (x [M, N] -> [M, K] with transpose), row i against W[g(i)] of the
    packed weights codes/scales [G, N, ...]; rows past sum(group_sizes) are 0."""
  fmt = formats.get(fmt)
  cfg = config or (INPUT_GRADIENT if transpose else FORWARD)
  cfg.check(fmt)
  num_groups, n = codes.shape[0], codes.shape[1]
  k = codes.shape[2] * fmt.per_code
  m = x.shape[0]
  out_cols = k if transpose else n
  segment, tile, first, end = row_tiles(group_sizes, m, cfg.bm)
  body = functools.partial(_kernel, fmt=fmt, transpose=transpose, cfg=cfg, n=n, k=k,
                           num_groups=num_groups)
  grid = (pl.cdiv(out_cols, cfg.bk if transpose else cfg.bn), segment.shape[0])
  return pl.pallas_call(
      body,
      grid=grid,
      out_shape=jax.ShapeDtypeStruct((m, out_cols), x.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      name=f"quantized_grouped_matmul_{fmt.name}{'_transposed' if transpose else ''}",
  )(segment, tile, first, end, x, codes, scales)

"""Grouped matmuls against packed weights, dequantized tile by tile: a Pallas (Triton
backend) kernel family.

    forward         x [M, K] (rows sorted by group) -> [M, N],  row i = x[i] @ W[g(i)]^T
    input gradient  x [M, N]                         -> [M, K],  row i = x[i] @ W[g(i)]

W[g] [N, K] is the weight that codes[g] and scales[g] stand for (formats.py). No bf16 copy
of a weight exists in memory: each program loads one [bn, bk] tile of packed codes and
its scales per step of the contraction, turns it into bf16 and multiplies it into a
float32 accumulator on the tensor cores. Both orientations read the same [N, K] tiles;
the forward contracts their K axis, the input gradient their N axis.

How a tile becomes bf16 (`TileConfig.dequant`):

  "bits"  mxfp4: the bf16 bit pattern is built with integer operations, the e8m0 exponent
          added into its exponent field; int4: bf16 bits 0x4300 | nibble are 128 + nibble,
          minus 136 is the signed value, times the bf16 scale rounded once; both equal
          formats.dequantize bit for bit. mxfp4 groups holding an exponent outside 2..252
          (subnormal, overflowing or NaN weights, which real checkpoints do not use) take
          the "f32" path, chosen per group. fp8_block: a tile inside one 128 x 128 scale
          block is converted to bf16 unscaled (exact) and the block's scale multiplies the
          tile's float32 product, acc += s * (x @ w): more exact than formats.dequantize,
          which rounds every s * w to bf16, so results differ from the reference by that
          rounding (within the tests' tolerance); tiles spanning blocks take "f32".
  "f32"   every element decoded in float32, multiplied by its scale and rounded to bf16,
          as formats.dequantize does.

`TileConfig.halves` (4-bit formats): the low and high nibbles of a byte (inputs 2j and
2j + 1) stay two [bn, bk/2] tiles, each multiplied with the matching columns of x (the
forward loads x's even and odd columns with stride 2; the input gradient keeps two
accumulators and stores even and odd output columns with stride 2), so the codes are
never interleaved. `TileConfig.gather_scales` loads the 4-bit scales one per element
(index k // 32) instead of repeating a [bn, bk/32] tile.

Grouping runs over rows: `row_tiles` lists (segment, row tile, first row, end row) for
every row tile each segment touches, the segments being the G groups and one more for
the rows past sum(group_sizes), whose outputs are written as zeros. There are at most
ceil(M / bm) + G such entries (a tile crossing a group boundary appears once per group),
so the grid is static; unused entries do nothing. Programs write only their own rows of a
tile (masked stores), so tiles shared by two groups are written without races; x is
loaded for the whole row tile (rows of a neighbouring group are multiplied and dropped),
masked only where a tile passes the end of an array.

Tile sizes, warps, pipeline stages and the variants above are `TileConfig`s, one per
format and orientation (`DEFAULT_TILES`); the benchmark's sweep tunes them.
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
BF16 = jnp.bfloat16
DEQUANT_MODES = ("bits", "f32")
# mxfp4 exponents whose weights the "bits" path builds exactly: below 2 the weight 0.5 *
# 2^(s-127) is subnormal, above 252 the largest weights overflow, 255 is NaN
MXFP4_EXACT_EXPONENTS = (2, 252)


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Tiles of one orientation: bm rows of x; bn rows and bk columns of the [N, K] weight
  tile (forward: bn output columns, bk contracted; input gradient: bn contracted, bk output
  columns); num_warps and num_stages (software pipelining of the contraction loop); how a
  tile is dequantized (module doc)."""
  bm: int = 128
  bn: int = 128
  bk: int = 64
  num_warps: int = 8
  num_stages: int = 4
  dequant: str = "bits"
  halves: bool = False
  gather_scales: bool = False

  def check(self, fmt: formats.Format) -> None:
    for name in ("bm", "bn", "bk"):
      size = getattr(self, name)
      if size < 16 or size & (size - 1):
        raise ValueError(f"tile {name}={size} must be a power of two >= 16")
    if fmt.per_code > 1 and self.bk < fmt.block[1]:
      raise ValueError(f"{fmt.name} needs bk >= {fmt.block[1]} (one scale per "
                       f"{fmt.block[1]} inputs), got bk={self.bk}")
    if self.dequant not in DEQUANT_MODES:
      raise ValueError(f"dequant must be one of {DEQUANT_MODES}, got {self.dequant!r}")
    if (self.halves or self.gather_scales) and fmt.per_code == 1:
      raise ValueError(f"halves and gather_scales are for 4-bit formats, not {fmt.name}")

  @property
  def name(self) -> str:
    flags = "".join(f"_{f}" for f in ("halves", "gather_scales") if getattr(self, f))
    return (f"bm{self.bm}_bn{self.bn}_bk{self.bk}_w{self.num_warps}_s{self.num_stages}_"
            f"{self.dequant}{flags}")


# Per (format, transpose); the benchmark's sweep (--sweep-quantized) picks them.
# The H200 sweep's best per format and orientation (bench_grouped_matmul.py
# --sweep-only; docs/performance.md): fp8 and the int4 forward keep the float32 dequant.
DEFAULT_TILES = {
    ("fp8_block", False): TileConfig(128, 128, 64, 8, 4, dequant="f32"),
    ("fp8_block", True): TileConfig(128, 64, 128, 8, 4, dequant="f32"),
    ("mxfp4", False): TileConfig(256, 128, 128, 8, 3),
    ("mxfp4", True): TileConfig(256, 128, 128, 8, 3),
    ("int4", False): TileConfig(256, 128, 128, 8, 3, dequant="f32"),
    ("int4", True): TileConfig(256, 64, 128, 8, 3),
}

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


def _within(start, size: int, limit: int):
  """bool [size]: start + i < limit; None when every tile is whole (start is a multiple of
    size, so no tile passes the end when size divides limit)."""
  return None if limit % size == 0 else start + _iota(size) < limit


def _mask2(rows, cols):
  """The [r, c] mask of row and column masks (None: all true)."""
  if rows is None and cols is None:
    return None
  if rows is None:
    return cols[None, :]
  return rows[:, None] if cols is None else rows[:, None] & cols[None, :]


def _load(at, mask, other=0):
  """A masked load (no mask, no fill value: Triton takes `other` only with a mask)."""
  return plgpu.load(at) if mask is None else plgpu.load(at, mask=mask, other=other)


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


def _bf16_from_bits(bits):
  """int32 holding bf16 bit patterns in the low 16 bits -> bf16."""
  return jax.lax.bitcast_convert_type(bits.astype(jnp.int16), BF16)


def _mxfp4_bf16(nibbles, exponent_field):
  """e2m1 nibbles under e8m0 exponent s, exponent_field = (s - 1) << 7 -> bf16, exact for
    s in MXFP4_EXACT_EXPONENTS: magnitude code c = 2e + m >= 2 is 2^(e-1) (1 + m/2) 2^(s-127),
    bf16 exponent field e + s - 1 and mantissa bit m, i.e. bits (c << 6) + ((s - 1) << 7);
    code 1 is 2^(s-128), bits (s - 1) << 7; the sign is bit 3."""
  c = nibbles & 7
  magnitude = jnp.where(c >= 2, (c << 6) + exponent_field, jnp.where(c == 1, exponent_field, 0))
  return _bf16_from_bits(magnitude | ((nibbles & 8) << 12))


def _int4_bf16(nibbles, scales):
  """int4 nibbles (value + 8), bf16 scales -> bf16: bf16 bits 0x4300 | q are 128 + q, so
    minus 136 is q - 8 exactly; the bf16 product rounds the exact product once, as
    formats.dequantize's float32 product (exact: 4 x 8 significant bits) rounded to bf16."""
  return (_bf16_from_bits(nibbles | 0x4300) - 136.0) * scales


def _unpack(codes):
  """int32 bytes [bn, bk/2] -> int32 nibbles [bn, bk], the low nibble first."""
  pairs = jnp.stack([codes & 0xF, codes >> 4], axis=-1)
  return pairs.reshape(codes.shape[0], 2 * codes.shape[1])


def _spread_columns(x, width):
  """[r, c] -> [r, c * width], each column repeated `width` times (no reordering)."""
  r, c = x.shape
  return jnp.broadcast_to(x[:, :, None], (r, c, width)).reshape(r, c * width)


def _spread_rows(x, height):
  """[r, c] -> [r * height, c], each row repeated `height` times (no reordering)."""
  r, c = x.shape
  return jnp.broadcast_to(x[:, None, :], (r, height, c)).reshape(r * height, c)


def _fp8_tile(codes_ref, scales_ref, g, n0, k0, *, fmt, bn, bk, n, k, dequant):
  br, bc = fmt.block
  mask = _mask2(_within(n0, bn, n), _within(k0, bk, k))
  # Triton has no fill value of fp8 type: lanes outside the matrix are zeroed after the
  # conversion
  codes = plgpu.load(codes_ref.at[g, pl.ds(n0, bn), pl.ds(k0, bk)], mask=mask)
  zero_outside = (lambda v: v) if mask is None else (lambda v: jnp.where(mask, v, 0))
  if bn <= br and bk <= bc:  # the tile lies inside one scale block
    scale = scales_ref[g, n0 // br, k0 // bc]
    if dequant == "bits":  # e4m3 values are bf16 values: scaled after the product
      return (zero_outside(codes.astype(BF16)),), scale
    return (zero_outside(codes.astype(F32) * scale).astype(BF16),), None
  values = zero_outside(codes.astype(F32))
  sr, sc = max(bn // br, 1), max(bk // bc, 1)
  srows = n0 // br + _iota(sr)
  scols = k0 // bc + _iota(sc)
  sok = (srows < scales_ref.shape[1])[:, None] & (scols < scales_ref.shape[2])[None, :]
  block = plgpu.load(scales_ref.at[g, pl.ds(n0 // br, sr),
                                   pl.ds(k0 // bc, sc)], mask=sok, other=0.0)
  block = _spread_rows(block, bn // sr) if sr > 1 else jnp.broadcast_to(block, (bn, sc))
  scale = _spread_columns(block, bk // sc) if sc > 1 else jnp.broadcast_to(block, (bn, bk))
  return ((values * scale).astype(BF16),), None


def _packed_tiles(codes_ref, scales_ref, g, n0, k0, *, fmt, cfg, n, k, dequant):
  bn, bk, per_scale = cfg.bn, cfg.bk, fmt.block[1]
  half, ns = bk // 2, bk // per_scale
  row_ok = _within(n0, bn, n)
  codes = _load(codes_ref.at[g, pl.ds(n0, bn), pl.ds(k0 // 2, half)],
                _mask2(row_ok, _within(k0 // 2, half, k // 2)))
  codes = codes.astype(jnp.int32)
  # even inputs (low nibbles) and odd ones (high nibbles) apart, or interleaved
  parts = (codes & 0xF, codes >> 4) if cfg.halves else (_unpack(codes),)
  width = parts[0].shape[1]
  repeat = per_scale * width // bk  # elements of a part under one scale
  if cfg.gather_scales:
    cols = k0 // per_scale + _iota(width) // repeat
    cols_ok = None if k % bk == 0 else cols < k // per_scale
    raw = _load(scales_ref.at[g, (n0 + _iota(bn))[:, None], cols[None, :]], _mask2(row_ok, cols_ok))
    spread = lambda s: s
  else:
    raw = _load(scales_ref.at[g, pl.ds(n0, bn), pl.ds(k0 // per_scale, ns)],
                _mask2(row_ok, _within(k0 // per_scale, ns, k // per_scale)))
    spread = lambda s: _spread_columns(s, repeat)
  if dequant == "bits" and fmt.name == "mxfp4":
    exponent_field = spread((raw.astype(jnp.int32) - 1) << 7)
    return tuple(_mxfp4_bf16(p, exponent_field) for p in parts), None
  if dequant == "bits":
    scale = spread(raw)
    return tuple(_int4_bf16(p, scale) for p in parts), None
  if fmt.name == "mxfp4":
    scale = spread(_e8m0_from_bits(raw.astype(jnp.int32)))
    return tuple((_e2m1_from_bits(p) * scale).astype(BF16) for p in parts), None
  scale = spread(raw.astype(F32))
  return tuple(((p - 8).astype(F32) * scale).astype(BF16) for p in parts), None


def weight_tiles(codes_ref, scales_ref, g, n0, k0, *, fmt, cfg: TileConfig, n, k, dequant):
  """The [bn, bk] tile of W[g] at (n0, k0) in bf16, zero outside [n, k], as (tiles, scale):
    tiles is (the tile,) or with cfg.halves (its even columns, its odd columns); scale is
    None, or (fp8_block "bits") the float32 scalar the tile's product is to be multiplied
    by."""
  if fmt.per_code == 1:
    return _fp8_tile(codes_ref, scales_ref, g, n0, k0, fmt=fmt, bn=cfg.bn, bk=cfg.bk, n=n, k=k,
                     dequant=dequant)
  return _packed_tiles(codes_ref, scales_ref, g, n0, k0, fmt=fmt, cfg=cfg, n=n, k=k,
                       dequant=dequant)


# ---- the kernel ------------------------------------------------------------------------

FORWARD_DIMS = (((1,), (1,)), ((), ()))  # x [bm, bk] . W [bn, bk] over bk
INPUT_GRADIENT_DIMS = (((1,), (0,)), ((), ()))  # x [bm, bn] . W [bn, bk] over bn


def _dot(x, w, dims):
  return jax.lax.dot_general(x, w, dims, preferred_element_type=F32)


def _kernel(segment_ref, tile_ref, first_ref, end_ref, needs_f32_ref, x_ref, codes_ref, scales_ref,
            out_ref, *, fmt, transpose, cfg, m, n, k, num_groups):
  """One program: output columns program_id(0), row-tile entry program_id(1)."""
  col_tile, entry = pl.program_id(0), pl.program_id(1)
  g, first, end = segment_ref[entry], first_ref[entry], end_ref[entry]
  row0 = tile_ref[entry] * cfg.bm
  rows = row0 + _iota(cfg.bm)
  store_rows = (rows >= first) & (rows < end)
  x_rows = _within(row0, cfg.bm, m)
  # forward: out columns along N (bn), contraction along K (bk); input gradient: swapped
  out_width, out_size = (cfg.bk, k) if transpose else (cfg.bn, n)
  step, depth = (cfg.bn, n) if transpose else (cfg.bk, k)
  c0 = col_tile * out_width
  active = end > first

  @pl.when(active & (g == num_groups))
  def _rows_past_groups():
    out_at = out_ref.at[pl.ds(row0, cfg.bm), pl.ds(c0, out_width)]
    plgpu.store(out_at, jnp.zeros((cfg.bm, out_width), out_ref.dtype),
                mask=_mask2(store_rows, c0 + _iota(out_width) < out_size))

  def load_x(d0, size, stride=1):
    """x [bm, size]: columns d0, d0 + stride, ... (zero past the depth)."""
    cols = None if depth % (size * stride) == 0 else d0 + stride * _iota(size) < depth
    if stride == 1:
      at = x_ref.at[pl.ds(row0, cfg.bm), pl.ds(d0, size)]
    else:  # index arrays rather than a strided slice, which interpret mode lacks
      at = x_ref.at[rows[:, None], (d0 + stride * _iota(size))[None, :]]
    return _load(at, _mask2(x_rows, cols)).astype(BF16)

  def product(dequant):
    tiles_at = functools.partial(weight_tiles, codes_ref, scales_ref, g, fmt=fmt, cfg=cfg, n=n, k=k,
                                 dequant=dequant)
    split_out = transpose and cfg.halves  # even and odd output columns accumulated apart
    width = out_width // 2 if split_out else out_width
    accs = tuple(jnp.zeros((cfg.bm, width), F32) for _ in range(2 if split_out else 1))

    def body(i, accs):
      d0 = i * step
      if transpose:
        tiles, scale = tiles_at(d0, c0)
        x = load_x(d0, step)
        parts = [_dot(x, w, INPUT_GRADIENT_DIMS) for w in tiles]
        if scale is not None:
          return (accs[0] + scale * parts[0],)
        return tuple(acc + part for acc, part in zip(accs, parts))
      tiles, scale = tiles_at(c0, d0)
      if cfg.halves:  # x's even columns against the low nibbles, its odd ones the high
        xs = [load_x(d0 + parity, step // 2, stride=2) for parity in (0, 1)]
      else:
        xs = [load_x(d0, step)]
      if scale is not None:
        return (accs[0] + scale * _dot(xs[0], tiles[0], FORWARD_DIMS),)
      acc = accs[0]
      for x, w in zip(xs, tiles):
        acc = acc + _dot(x, w, FORWARD_DIMS)
      return (acc,)

    accs = jax.lax.fori_loop(0, pl.cdiv(depth, step), body, accs)
    if split_out:
      for parity, acc in enumerate(accs):
        cols = c0 + parity + 2 * _iota(width)
        plgpu.store(out_ref.at[rows[:, None], cols[None, :]], acc.astype(out_ref.dtype),
                    mask=_mask2(store_rows, cols < out_size))
    else:
      plgpu.store(out_ref.at[pl.ds(row0, cfg.bm), pl.ds(c0, out_width)],
                  accs[0].astype(out_ref.dtype), mask=_mask2(store_rows, c0 + _iota(out_width)
                                                             < out_size))

  in_groups = active & (g < num_groups)
  if fmt.name == "mxfp4" and cfg.dequant == "bits":
    # groups holding an exponent the integer path cannot build take the float32 path
    needs_f32 = needs_f32_ref[g]
    pl.when(in_groups & (needs_f32 == 0))(lambda: product("bits"))
    pl.when(in_groups & (needs_f32 != 0))(lambda: product("f32"))
  else:
    pl.when(in_groups)(lambda: product(cfg.dequant))


def groups_needing_f32(scales, fmt: formats.Format) -> jax.Array:
  """int32 [G + 1]: 1 for the mxfp4 groups holding an exponent outside
    MXFP4_EXACT_EXPONENTS (the last entry, the rows past the groups, 0)."""
  if fmt.name != "mxfp4":
    return jnp.zeros((scales.shape[0] + 1,), jnp.int32)
  lo, hi = MXFP4_EXACT_EXPONENTS
  outside = jnp.any((scales < lo) | (scales > hi), axis=(1, 2)).astype(jnp.int32)
  return jnp.concatenate([outside, jnp.zeros((1,), jnp.int32)])


def quantized_grouped_matmul_kernel(x, codes, scales, group_sizes, *, fmt: str, transpose: bool,
                                    config: TileConfig | None = None, interpret: bool = False):
  """x [M, K] -> [M, N] (x [M, N] -> [M, K] with transpose), row i against W[g(i)] of the
    packed weights codes/scales [G, N, ...]; rows past sum(group_sizes) are 0."""
  fmt = formats.get(fmt)
  cfg = config or DEFAULT_TILES[(fmt.name, transpose)]
  cfg.check(fmt)
  num_groups, n = codes.shape[0], codes.shape[1]
  k = codes.shape[2] * fmt.per_code
  m = x.shape[0]
  out_cols = k if transpose else n
  segment, tile, first, end = row_tiles(group_sizes, m, cfg.bm)
  body = functools.partial(_kernel, fmt=fmt, transpose=transpose, cfg=cfg, m=m, n=n, k=k,
                           num_groups=num_groups)
  grid = (pl.cdiv(out_cols, cfg.bk if transpose else cfg.bn), segment.shape[0])
  return pl.pallas_call(
      body,
      grid=grid,
      out_shape=jax.ShapeDtypeStruct((m, out_cols), x.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      name=f"quantized_grouped_matmul_{fmt.name}{'_transposed' if transpose else ''}",
  )(segment, tile, first, end, groups_needing_f32(scales, fmt), x, codes, scales)

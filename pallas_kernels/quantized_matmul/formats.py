"""The packed weight formats a frozen base ships in, per matrix in the checkpoint's own
orientation `[out, in]` (N x K), with any leading stack dimensions:

  fp8_block  float8_e4m3fn codes [N, K] and float32 scales [ceil(N/128), ceil(K/128)], one
             per 128 x 128 block (DeepSeek-V3/V3.2, Kimi K2, MiniMax-M2: `weight_scale_inv`,
             multiplied in);
  mxfp4      uint8 [N, K/2], two e2m1 codes per byte (element 2j in the low nibble), and
             uint8 e8m0 scales [N, K/32] (2^(s-127); 255 is NaN), one per 32 inputs
             (compressed-tensors `mxfp4-pack-quantized`, Kimi K3's routed experts);
  int4       uint8 [N, K/2], two codes per byte as above, each the signed value + 8, and
             bfloat16 scales [N, K/32] (compressed-tensors `pack-quantized`, symmetric,
             group 32: Kimi K2-Thinking; the file's int32 [N, K/8] words are these bytes
             read little-endian).

Everything here is plain `jnp` on whole arrays or on a kernel's tiles: `decode` (codes ->
float32 values), `scale_values`, `dequantize`, and `quantize` (float -> codes and scales,
round to nearest: how test checkpoints and random packed bases are made).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Format:
  name: str
  codes_dtype: object
  scales_dtype: object
  per_code: int  # values of `in` per stored element (2: a byte holds two 4-bit codes)
  block: tuple[int, int]  # (rows of out, columns of in) one scale covers

  def codes_shape(self, n: int, k: int) -> tuple[int, int]:
    return (n, k // self.per_code)

  def scales_shape(self, n: int, k: int) -> tuple[int, int]:
    return (-(-n // self.block[0]), -(-k // self.block[1]))

  def check_matrix(self, n: int, k: int) -> str | None:
    """Why an [n, k] matrix cannot take this format (None: it can)."""
    if self.per_code > 1 and k % self.block[1]:
      return f"{self.name} packs `in` in groups of {self.block[1]}; in = {k} is not a multiple"
    return None

  def nbytes(self, n: int, k: int) -> int:
    """Bytes of one [n, k] matrix: codes and scales."""
    return (math.prod(self.codes_shape(n, k)) * jnp.dtype(self.codes_dtype).itemsize +
            math.prod(self.scales_shape(n, k)) * jnp.dtype(self.scales_dtype).itemsize)


FP8_BLOCK = Format("fp8_block", jnp.float8_e4m3fn, jnp.float32, 1, (128, 128))
MXFP4 = Format("mxfp4", jnp.uint8, jnp.uint8, 2, (1, 32))
INT4 = Format("int4", jnp.uint8, jnp.bfloat16, 2, (1, 32))
FORMATS = {f.name: f for f in (FP8_BLOCK, MXFP4, INT4)}

FP8_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0
INT4_MAX = 7


def get(name: str) -> Format:
  if name not in FORMATS:
    raise ValueError(f"unknown packed weight format {name!r}; known: {', '.join(FORMATS)}")
  return FORMATS[name]


# ---- decoding -------------------------------------------------------------------------


def unpack_nibbles(packed: jax.Array) -> jax.Array:
  """uint8 [..., K/2] -> uint8 [..., K]: the low nibble is the even element."""
  low, high = packed & 0xF, packed >> 4
  return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def e2m1_values(nibbles: jax.Array) -> jax.Array:
  """4-bit e2m1 codes (sign, 2 exponent bits, 1 mantissa bit) -> float32:
  0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
  nibbles = nibbles.astype(jnp.int32)
  exponent, mantissa = (nibbles >> 1) & 3, nibbles & 1
  twice = jnp.where(exponent == 0, mantissa, (2 + mantissa) << jnp.maximum(exponent - 1, 0))
  magnitude = twice.astype(jnp.float32) * 0.5
  return jnp.where(nibbles >= 8, -magnitude, magnitude)


def e8m0_values(scales: jax.Array) -> jax.Array:
  """uint8 e8m0 exponents -> float32 2^(s-127); 0 is 2^-127 (a subnormal), 255 is NaN."""
  s = scales.astype(jnp.uint32)
  bits = jnp.where(s == 0, jnp.uint32(0x00400000),
                   jnp.where(s == 255, jnp.uint32(0x7FC00000), s << 23))
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def decode(codes: jax.Array, fmt: Format) -> jax.Array:
  """Codes [..., N, K / per_code] -> unscaled float32 values [..., N, K]."""
  if fmt.name == "fp8_block":
    return codes.astype(jnp.float32)
  nibbles = unpack_nibbles(codes)
  if fmt.name == "mxfp4":
    return e2m1_values(nibbles)
  return (nibbles.astype(jnp.int32) - 8).astype(jnp.float32)


def scale_values(scales: jax.Array, fmt: Format) -> jax.Array:
  return e8m0_values(scales) if fmt.name == "mxfp4" else scales.astype(jnp.float32)


def expand_scales(scales: jax.Array, fmt: Format, n: int, k: int) -> jax.Array:
  """float32 scales [..., N / bn, K / bk] -> one per element [..., N, K]."""
  rows, cols = fmt.block
  full = jnp.repeat(jnp.repeat(scales, rows, axis=-2), cols, axis=-1)
  return full[..., :n, :k]


def dequantize(codes: jax.Array, scales: jax.Array, fmt: Format | str,
               dtype=jnp.bfloat16) -> jax.Array:
  """The weights [..., N, K] the codes and scales stand for, computed in float32 and
  rounded once to `dtype`."""
  fmt = get(fmt) if isinstance(fmt, str) else fmt
  values = decode(codes, fmt)
  n, k = values.shape[-2:]
  return (values * expand_scales(scale_values(scales, fmt), fmt, n, k)).astype(dtype)


# ---- quantizing -----------------------------------------------------------------------


def _block_amax(w: jax.Array, fmt: Format) -> jax.Array:
  """max |w| over each scale's block: [..., N, K] -> [..., N / bn, K / bk] (edges padded)."""
  rows, cols = fmt.block
  n, k = w.shape[-2:]
  sn, sk = fmt.scales_shape(n, k)
  pad = [(0, 0)] * (w.ndim - 2) + [(0, sn * rows - n), (0, sk * cols - k)]
  blocks = jnp.pad(jnp.abs(w), pad).reshape(*w.shape[:-2], sn, rows, sk, cols)
  return blocks.max(axis=(-3, -1))


def _nearest_e2m1(x: jax.Array) -> jax.Array:
  """float32 in [-6, 6] -> the nearest e2m1 nibble (ties to the even code)."""
  magnitudes = e2m1_values(jnp.arange(8, dtype=jnp.uint8))
  distance = jnp.abs(jnp.abs(x)[..., None] - magnitudes)
  code = jnp.argmin(distance, axis=-1).astype(jnp.uint8)  # first (even) code wins a tie
  return jnp.where((x < 0) & (code > 0), code | 8, code)


def pack_nibbles(nibbles: jax.Array) -> jax.Array:
  """uint8 [..., K] in 0..15 -> uint8 [..., K/2] (element 2j in the low nibble)."""
  pairs = nibbles.astype(jnp.uint8).reshape(*nibbles.shape[:-1], -1, 2)
  return pairs[..., 0] | (pairs[..., 1] << 4)


def quantize(w: jax.Array, fmt: Format | str) -> tuple[jax.Array, jax.Array]:
  """Weights [..., N, K] -> (codes, scales) of `fmt`, each block scaled so its largest
  magnitude meets the format's largest code."""
  fmt = get(fmt) if isinstance(fmt, str) else fmt
  w = w.astype(jnp.float32)
  n, k = w.shape[-2:]
  reason = fmt.check_matrix(n, k)
  if reason:
    raise ValueError(reason)
  amax = _block_amax(w, fmt)
  if fmt.name == "fp8_block":
    scales = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    codes = (w / expand_scales(scales, fmt, n, k)).astype(jnp.float8_e4m3fn)
    return codes, scales
  if fmt.name == "mxfp4":
    # the smallest power of two that brings the block's max within e2m1's range
    exponent = jnp.ceil(jnp.log2(jnp.where(amax > 0, amax, 1.0) / E2M1_MAX))
    scales = jnp.clip(exponent + 127, 1, 254).astype(jnp.uint8)
    x = w / expand_scales(e8m0_values(scales), fmt, n, k)
    return pack_nibbles(_nearest_e2m1(jnp.clip(x, -E2M1_MAX, E2M1_MAX))), scales
  scales = jnp.where(amax > 0, amax / INT4_MAX, 1.0).astype(jnp.bfloat16)
  x = w / expand_scales(scales.astype(jnp.float32), fmt, n, k)
  q = jnp.clip(jnp.round(x), -8, INT4_MAX).astype(jnp.int32) + 8
  return pack_nibbles(q), scales


def random_codes(key: jax.Array, shape: tuple[int, ...], fmt: Format | str,
                 std: float) -> tuple[jax.Array, jax.Array]:
  """Random packed weights [..., N, K] of about `std`: normal draws quantized."""
  w = std * jax.random.normal(key, shape, jnp.float32)
  return quantize(w, fmt)

"""Rotary position embedding: the half-split and the interleaved-pair conventions, with
plain or YaRN frequencies."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class YaRN:
  """YaRN context extension as DeepSeek configures it (rope_type "yarn")."""

  factor: float
  original_max_positions: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 1.0
  mscale_all_dim: float = 0.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction, 0.1 * mscale * ln(factor) + 1 (1 without extension)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(dim: int, theta: float, yarn: YaRN | None = None) -> tuple[np.ndarray, float]:
  """(inverse frequencies fp32 [dim // 2], attention factor) of a `dim`-wide rotary part.

  The attention factor scales the rotated vectors (cos and sin): 1 for plain RoPE. The
  frequencies are computed in fp32 as the published implementations do, so that angles
  at large positions agree with theirs.
  """
  exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
  pos_freqs = np.float32(theta)**exponents
  extrapolated = (np.float32(1.0) / pos_freqs).astype(np.float32)
  if yarn is None or yarn.factor <= 1:
    return extrapolated, 1.0
  factor = yarn.factor
  if yarn.mscale and yarn.mscale_all_dim:
    attention_factor = yarn_mscale(factor, yarn.mscale) / yarn_mscale(factor, yarn.mscale_all_dim)
  else:
    attention_factor = yarn_mscale(factor)
  interpolated = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)

  def correction_dim(rotations: float) -> float:
    # the dimension whose wavelength fits `rotations` times into the original context
    return (dim * math.log(yarn.original_max_positions /
                           (rotations * 2 * math.pi))) / (2 * math.log(theta))

  low = max(math.floor(correction_dim(yarn.beta_fast or 32)), 0)
  high = min(math.ceil(correction_dim(yarn.beta_slow or 1)), dim - 1)
  if low == high:
    high += 0.001  # a ramp of width zero
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / np.float32(high - low), 0, 1)
  # Fast-rotating dimensions (below `low`) keep their frequency, slow ones (above `high`)
  # are interpolated by `factor`, a linear ramp in between.
  keep = (np.float32(1.0) - ramp).astype(np.float32)
  inv_freq = interpolated * (np.float32(1.0) - keep) + extrapolated * keep
  return inv_freq.astype(np.float32), float(attention_factor)


def _cos_sin(positions: jax.Array, inv_freq, attention_factor: float):
  """cos, sin [B, T, 1, D/2] of positions [B, T], scaled by the attention factor."""
  angles = positions.astype(jnp.float32)[..., None, None] * jnp.asarray(inv_freq, jnp.float32)
  return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x: jax.Array, positions: jax.Array, theta: float | None = None, *, inv_freq=None,
               attention_factor: float = 1.0) -> jax.Array:
  """x [B, T, H, D] rotated by positions [B, T] (half-split convention: dimension i pairs
  with i + D/2). Frequencies from `theta`, or `inv_freq` [D/2] when given."""
  d = x.shape[-1]
  if inv_freq is None:
    inv_freq = theta**(-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
  cos, sin = _cos_sin(positions, inv_freq, attention_factor)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def apply_rope_interleaved(x: jax.Array, positions: jax.Array, inv_freq,
                           attention_factor: float = 1.0) -> jax.Array:
  """x [B, T, H, D] rotated by positions [B, T] with DeepSeek's pairs (x0, x1), (x2, x3), ...

  The result is laid out as [rotated evens | rotated odds], as DeepSeek's published
  implementation lays it out: queries and keys get the same permutation, so their dot
  products are those of the in-place rotation.
  """
  cos, sin = _cos_sin(positions, inv_freq, attention_factor)
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., 0::2], xf[..., 1::2]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)

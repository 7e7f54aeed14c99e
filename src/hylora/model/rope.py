"""Rotary position embedding (sparse-attention layers only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """x [B, T, H, D] rotated by positions [B, T] (half-split convention)."""
  d = x.shape[-1]
  freqs = theta**(-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
  angles = positions.astype(jnp.float32)[..., None, None] * freqs  # [B, T, 1, D/2]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)

"""RMSNorm computed in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hylora.model.init import logical


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """The reference op (also registered as "rms_norm"): fp32 math, x's dtype out."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (y * weight.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, axis_name: str, *, eps: float = 1e-6):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), **logical(None))
    self.eps = eps
    del axis_name  # norms are small: replicated

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.scale[...], self.eps)

"""LayerNorm (scale and bias) in fp32, as ViT encoders use it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hylora.model.init import logical


class LayerNorm(nnx.Module):

  def __init__(self, dim: int, *, eps: float = 1e-6):
    # Small vectors: replicated, like the RMSNorm scales of the language model.
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), **logical(None))
    self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32), **logical(None))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.scale[...] + self.bias[...]).astype(x.dtype)

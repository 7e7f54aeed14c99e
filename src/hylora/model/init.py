"""Counter-based parameter initialisation.

Each draw hashes (seed, draw counter, element index) with a murmur-style integer mixer
and maps pairs of uniforms to normals (Box-Muller). Unlike threefry key splitting, this
compiles to a few fused elementwise ops, so building even a deep model under `jit` or
`eval_shape` stays fast; under `nnx.vmap` the seed is batched and every stacked layer
gets its own values.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_GOLDEN = 0x9E3779B1


def _mix(x: jax.Array) -> jax.Array:
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def weight_std(init_std: float, fan_in: int) -> float:
  """The configured std, or 1/sqrt(fan_in) when it is 0."""
  return init_std if init_std > 0 else fan_in**-0.5


class ParamInit:
  """Hands out independent random tensors from one uint32 seed."""

  def __init__(self, seed):
    self.seed = jnp.asarray(seed, jnp.uint32)
    self.draws = 0

  def fork(self, count: int) -> jax.Array:
    """`count` seeds for independent sub-initialisers (e.g. stacked layers)."""
    self.draws += 1
    base = _mix(self.seed ^ jnp.uint32((self.draws * _GOLDEN) & 0xFFFFFFFF))
    return _mix(base + jnp.arange(count, dtype=jnp.uint32) * jnp.uint32(_GOLDEN))

  def normal(self, shape, std: float = 1.0, dtype=jnp.float32, clip: float | None = None):
    self.draws += 1
    stream = _mix(self.seed ^ _mix(jnp.uint32((self.draws * _GOLDEN) & 0xFFFFFFFF)))
    n = math.prod(shape)
    bits = _mix(jax.lax.iota(jnp.uint32, 2 * n) * jnp.uint32(_GOLDEN) + stream)
    u = (bits >> 8).astype(jnp.float32) * (1.0 / (1 << 24)) + (0.5 / (1 << 24))
    z = jnp.sqrt(-2.0 * jnp.log(u[:n])) * jnp.cos(2.0 * jnp.pi * u[n:])
    if clip is not None:
      z = jnp.clip(z, -clip, clip)
    return (std * z).reshape(shape).astype(dtype)


def logical(*names) -> dict:
  """A variable's sharding metadata: the logical axis of each dimension
  (`meshes.logical_axes`). The train step places variables by these names
  (`meshes.rules`); nothing is placed at creation, so a model builds without a mesh."""
  return {"out_sharding": names, "eager_sharding": False}

"""The gated activation of every MLP (dense, shared and routed experts), chosen by
`model.activation`:

  "silu"  SwiGLU: silu(gate) * up, in the activations' dtype.
  "situ"  K3's SiTU-GLU, in fp32: beta tanh(gate / beta) sigmoid(gate) * up', where
          up' = linear_beta tanh(up / linear_beta) bounds the linear half (up itself when
          situ_linear_beta <= 0).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hylora.core.config import ModelConfig
from hylora.core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Activation:
  """The settings of one gated activation; immutable, so it travels as a static option
  (the routed experts' dispatchers pass it through to `expert_ffn`)."""

  kind: str = "silu"
  beta: float = 4.0
  linear_beta: float = 25.0

  @classmethod
  def of(cls, m: ModelConfig) -> "Activation":
    if m.activation not in ("silu", "situ"):
      raise ConfigError(f"model.activation: unknown activation {m.activation!r}")
    return cls(m.activation, m.situ_beta, m.situ_linear_beta)

  def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
    if self.kind == "silu":
      return jax.nn.silu(gate) * up
    g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
    if self.linear_beta > 0:
      u = self.linear_beta * jnp.tanh(u / self.linear_beta)
    out = self.beta * jnp.tanh(g / self.beta) * jax.nn.sigmoid(g) * u
    return out.astype(gate.dtype)


def gated(gate: jax.Array, up: jax.Array, m: ModelConfig) -> jax.Array:
  """The gated activation `m.activation` of a gated MLP's two halves."""
  return Activation.of(m)(gate, up)

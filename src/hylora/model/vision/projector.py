"""Encoder features -> image tokens in the LM's width: merge x merge neighbouring patches
are concatenated (fewer tokens per tile), normalised, then a GELU MLP maps them to d."""

from __future__ import annotations

import jax
from flax import nnx

from meshes import logical_axes as ax
from hylora.core.config import LoRAConfig, ModelConfig
from hylora.model.init import ParamInit
from hylora.model.vision.block import vision_linear
from hylora.model.vision.layer_norm import LayerNorm


def merge_patches(features: jax.Array, merge: int) -> jax.Array:
  """[N, g, g, w] -> [N, (g/m)^2, m*m*w]: tokens in row-major order of the merged grid."""
  n, g, _, w = features.shape
  gm = g // merge
  x = features.reshape(n, gm, merge, gm, merge, w).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(n, gm * gm, merge * merge * w)


class Projector(nnx.Module):

  def __init__(self, m: ModelConfig, lora: LoRAConfig | None, *, init: ParamInit):
    v, d = m.vision, m.d_model
    merged = v.merge * v.merge * v.width
    self.merge = v.merge
    self.norm = LayerNorm(merged)
    # Its hidden width is d: it shards like an MLP width.
    self.proj_in = vision_linear(m, lora, "proj_in", (merged,), (d,), (None,), (ax.MLP,), init=init)
    self.proj_out = vision_linear(m, lora, "proj_out", (d,), (d,), (ax.MLP,), (ax.EMBED,),
                                  init=init)

  def __call__(self, features: jax.Array, dropout_key=None) -> jax.Array:
    """[N, g, g, w] -> [N, tokens_per_tile, d]."""
    x = self.norm(merge_patches(features, self.merge))
    return self.proj_out(jax.nn.gelu(self.proj_in(x, dropout_key)), dropout_key)

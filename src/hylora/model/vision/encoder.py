"""The ViT encoder: patch embedding, learned 2-D (row + column) positions, a scanned
stack of blocks and a final LayerNorm. It sees one square tile at a time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshes import logical_axes as ax
from hylora.model import remat_policy
from hylora.core.config import LoRAConfig, MemoryConfig, ModelConfig
from hylora.model.init import ParamInit, logical
from hylora.model.vision.block import EncoderBlock, vision_linear
from hylora.model.vision.layer_norm import LayerNorm
from meshes.rules import constrain


def patchify(tiles: jax.Array, patch: int) -> jax.Array:
  """[N, S, S, C] -> [N, (S/p)^2, p*p*C], patches in row-major order."""
  n, s, _, c = tiles.shape
  g = s // patch
  x = tiles.reshape(n, g, patch, g, patch, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(n, g * g, patch * patch * c)


def normalize_pixels(tiles: jax.Array) -> jax.Array:
  """uint8 pixels -> [-1, 1] in bf16."""
  return (tiles.astype(jnp.float32) * (2.0 / 255.0) - 1.0).astype(jnp.bfloat16)


class VisionEncoder(nnx.Module):

  def __init__(self, m: ModelConfig, lora: LoRAConfig | None, *, init: ParamInit):
    v = m.vision
    self.cfg = v
    pixels = v.patch_size * v.patch_size * 3
    self.patch_embed = vision_linear(m, lora, "patch_embed", (pixels,), (v.width,), (None,),
                                     (ax.EMBED,), init=init)
    self.row_position = nnx.Param(init.normal((v.grid, v.width), 0.02, jnp.bfloat16),
                                  **logical(None, ax.EMBED))
    self.col_position = nnx.Param(init.normal((v.grid, v.width), 0.02, jnp.bfloat16),
                                  **logical(None, ax.EMBED))

    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: ax.LAYERS})
    def make(seed):
      return EncoderBlock(m, lora, init=ParamInit(seed))

    self.blocks = make(init.fork(v.layers))
    self.final_norm = LayerNorm(v.width)

  def __call__(self, tiles: jax.Array, dropout_key=None,
               memory: MemoryConfig = MemoryConfig()) -> jax.Array:
    """tiles [N, S, S, 3] uint8 -> features [N, grid, grid, width]; each block under
    `memory`'s remat policy."""
    v = self.cfg
    x = self.patch_embed(patchify(normalize_pixels(tiles), v.patch_size), dropout_key)
    pos = self.row_position[...][:, None, :] + self.col_position[...][None, :, :]
    x = x + pos.reshape(v.grid * v.grid, v.width).astype(x.dtype)
    x = constrain(x, (ax.BATCH, ax.SEQ, ax.EMBED))

    graphdef, state = nnx.split(self.blocks)

    def body(carry, xs):
      block_state, index = xs
      key = None if dropout_key is None else jax.random.fold_in(dropout_key, index)
      return nnx.merge(graphdef, block_state)(carry, key), None

    x, _ = jax.lax.scan(remat_policy.wrap(body, memory), x, (state, jnp.arange(v.layers)))
    x = self.final_norm(x)
    return x.reshape(x.shape[0], v.grid, v.grid, v.width)

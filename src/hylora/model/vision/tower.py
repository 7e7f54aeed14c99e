"""Encoder + projector + placement: what the language model calls with a batch's tiles."""

from __future__ import annotations

import jax
from flax import nnx

from hylora.core.config import LoRAConfig, ModelConfig
from hylora.core.errors import DataError
from hylora.model.init import ParamInit
from hylora.model.vision.encoder import VisionEncoder
from hylora.model.vision.placement import place_image_tokens
from hylora.model.vision.projector import Projector


class VisionTower(nnx.Module):

  def __init__(self, m: ModelConfig, lora: LoRAConfig | None, *, init: ParamInit):
    self.cfg = m.vision
    self.encoder = VisionEncoder(m, lora, init=init)
    self.projector = Projector(m, lora, init=init)

  def encode(self, tiles: jax.Array, ctx) -> jax.Array:
    """tiles [N, S, S, 3] uint8 -> image tokens [N, tokens_per_tile, d]."""
    key = None if ctx.dropout_key is None else jax.random.fold_in(ctx.dropout_key, 0x715)
    return self.projector(self.encoder(tiles, key, ctx.execution.memory), key)

  def check_shapes(self, x, images, image_positions) -> None:
    v = self.cfg
    b, r = images.shape[:2]
    want_images = (b, r, v.image_size, v.image_size, 3)
    if tuple(images.shape) != want_images:
      raise DataError(f"batch['images']: shape {tuple(images.shape)}, expected {want_images} "
                      "(rows, tiles per row, tile side, tile side, RGB)")
    want_positions = (b, r, v.tokens_per_tile)
    if image_positions is None or tuple(image_positions.shape) != want_positions:
      got = None if image_positions is None else tuple(image_positions.shape)
      raise DataError(f"batch['image_positions']: shape {got}, expected {want_positions} "
                      "(rows, tiles per row, tokens per tile)")
    if x.shape[0] != b:
      raise DataError(f"batch['images'] has {b} rows but the tokens have {x.shape[0]}")

  def __call__(self, x: jax.Array, images: jax.Array, image_positions: jax.Array, ctx) -> jax.Array:
    """x [B, T, d] embeddings; images [B, R, S, S, 3] uint8; image_positions [B, R, n];
    ctx the ForwardContext (dropout key, remat policy)."""
    self.check_shapes(x, images, image_positions)
    b, r = images.shape[:2]
    tokens = self.encode(images.reshape(b * r, *images.shape[2:]), ctx)
    return place_image_tokens(x, tokens.reshape(b, r, *tokens.shape[1:]), image_positions)


def build_vision(m: ModelConfig, lora: LoRAConfig | None, init: ParamInit):
  """The tower when model.vision.enabled, else None; its weights come from their own
  seed stream, so enabling it leaves every language-model weight unchanged."""
  if not m.vision.enabled:
    return nnx.data(None)
  return VisionTower(m, lora, init=ParamInit(init.fork(1)[0]))

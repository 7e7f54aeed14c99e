"""Image tokens replace the embeddings at their placeholder positions."""

from __future__ import annotations

import jax


def place_image_tokens(x: jax.Array, image_tokens: jax.Array,
                       image_positions: jax.Array) -> jax.Array:
  """x [B, T, d]; image_tokens [B, R, n, d]; image_positions [B, R, n] int: the sequence
  index of every image token, -1 for an unused tile slot. Returns x with
  x[b, image_positions[b, r, i]] = image_tokens[b, r, i]; every other entry unchanged."""
  b, t, d = x.shape
  tokens = image_tokens.reshape(b, -1, d).astype(x.dtype)
  positions = image_positions.reshape(b, -1)
  positions = jax.numpy.where(positions < 0, t, positions)  # out of range: dropped

  def one_row(row, row_tokens, row_positions):
    return row.at[row_positions].set(row_tokens, mode="drop")

  return jax.vmap(one_row)(x, tokens, positions)

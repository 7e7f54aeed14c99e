"""Examples -> fixed-length rows, in order, never splitting an example.

Same conventions as hylora.data.sources.Packer: `segment_ids` number the examples of a row
from 1 (0 = padding), `positions` restart at each example, `labels` hold the next token
of the same example where that token is trained (IGNORE_INDEX elsewhere). Each row also
carries up to `tiles_per_row` image tiles and, for every tile, the sequence positions of
its image tokens (-1 for unused slots). An example longer than a row is truncated (the
caller counts it); one that does not fit the space or the tile slots left in a row starts
the next row.
"""

from __future__ import annotations

import numpy as np

from hylora.data.example import Example
from hylora.data.sources import IGNORE_INDEX


def example_labels(example: Example) -> np.ndarray:
  """labels[i] = tokens[i + 1] where that token is trained, else IGNORE_INDEX."""
  labels = np.full(len(example), IGNORE_INDEX, np.int32)
  labels[:-1] = np.where(example.trained[1:], example.tokens[1:], IGNORE_INDEX)
  return labels


class Row:

  def __init__(self, seq_len: int, tiles_per_row: int, tile_side: int, tokens_per_tile: int):
    self.seq_len, self.tiles_per_row, self.tokens_per_tile = seq_len, tiles_per_row, tokens_per_tile
    self.tokens = np.zeros(seq_len, np.int32)
    self.labels = np.full(seq_len, IGNORE_INDEX, np.int32)
    self.segment_ids = np.zeros(seq_len, np.int32)
    self.positions = np.zeros(seq_len, np.int32)
    self.images = np.zeros((tiles_per_row, tile_side, tile_side, 3), np.uint8)
    self.image_positions = np.full((tiles_per_row, tokens_per_tile), -1, np.int32)
    self.fill = self.segments = self.tiles = 0

  def fits(self, example: Example) -> bool:
    return (self.fill + len(example) <= self.seq_len and
            self.tiles + len(example.tiles) <= self.tiles_per_row)

  def add(self, example: Example) -> None:
    n, start = len(example), self.fill
    self.segments += 1
    span = slice(start, start + n)
    self.tokens[span] = example.tokens
    self.labels[span] = example_labels(example)
    self.segment_ids[span] = self.segments
    self.positions[span] = np.arange(n)
    for tile, tile_start in zip(example.tiles, example.tile_starts):
      self.images[self.tiles] = tile
      self.image_positions[self.tiles] = start + tile_start + np.arange(self.tokens_per_tile)
      self.tiles += 1
    self.fill += n

  def arrays(self, with_images: bool) -> dict[str, np.ndarray]:
    out = {
        "tokens": self.tokens,
        "labels": self.labels,
        "segment_ids": self.segment_ids,
        "positions": self.positions
    }
    if with_images:
      out.update(images=self.images, image_positions=self.image_positions)
    return out

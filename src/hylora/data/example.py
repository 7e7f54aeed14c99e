"""A record tokenised: token ids, which of them the loss trains on, and its image tiles."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Example:
  where: str  # the record it came from ("file.jsonl:line")
  tokens: np.ndarray  # [n] int32
  trained: np.ndarray  # [n] bool: the token is a loss target (assistant turns, plain text)
  tiles: np.ndarray  # [k, S, S, 3] uint8
  tile_starts: np.ndarray  # [k] int32: index of each tile's first placeholder token

  def __len__(self) -> int:
    return len(self.tokens)

  def truncated(self, length: int, tokens_per_tile: int) -> "Example":
    """The first `length` tokens, cut before any image whose tokens would not all fit."""
    ends = self.tile_starts + tokens_per_tile
    kept = ends <= length
    cut = length
    if (~kept).any():
      cut = min(length, int(self.tile_starts[~kept].min()))
      kept = ends <= cut
    return dataclasses.replace(self, tokens=self.tokens[:cut], trained=self.trained[:cut],
                               tiles=self.tiles[kept], tile_starts=self.tile_starts[kept])


@dataclasses.dataclass(frozen=True)
class Skipped:
  """A bad record passed over (train.skip_bad_records): why, for the count and the log."""

  where: str
  reason: str

"""Record -> Example: the chat template applied, the loss mask on assistant turns, the
images loaded and tiled, every token checked against the model's vocabulary."""

from __future__ import annotations

import numpy as np

from hylora.core.config import VisionConfig
from hylora.data.chat import ChatTokenizer
from hylora.data.example import Example, Skipped
from hylora.data.images import load_tiles
from hylora.data.records import Record, parse_record
from hylora.core.errors import DataError


class ExampleEncoder:

  def __init__(self, tokenizer: ChatTokenizer, vision: VisionConfig, tiles_per_row: int, base_dir,
               skip_bad: bool = False):
    self.tok, self.vision = tokenizer, vision
    self.tiles_per_row = tiles_per_row if vision.enabled else 0
    self.base_dir, self.skip_bad = base_dir, skip_bad

  def __call__(self, item: tuple[str, str]) -> Example | Skipped:
    """(where, JSONL line) -> Example, or Skipped when configured to skip bad records."""
    where, line = item
    try:
      return self.encode(parse_record(line, where, self.base_dir))
    except DataError as e:
      if self.skip_bad:
        return Skipped(where, str(e))
      raise

  def encode(self, record: Record) -> Example:
    ids, trained, tiles, starts = [], [], [], []

    def add(token_ids, train: bool):
      ids.extend(token_ids)
      trained.extend([train] * len(token_ids))

    special = self.tok.ids
    if record.text is not None:
      add(self._text(record.text, record.where) + [special["end_of_text"]], True)
    else:
      for message in record.messages:
        assistant = message.role == "assistant"
        add([special["turn_start"]] + self.tok.encode(message.role + "\n"), False)
        for part in message.parts:
          if part.kind == "text":
            add(self._text(part.value, record.where), assistant)
            continue
          self._check_images_allowed(record.where)
          for tile in load_tiles(part.value, self.vision, record.where):
            starts.append(len(ids))
            tiles.append(tile)
            add([special["image"]] * self.vision.tokens_per_tile, False)
        # The turn's end is a target of assistant turns: the model learns to stop.
        add([special["turn_end"]], assistant)
        add(self.tok.encode("\n"), False)
    if len(tiles) > self.tiles_per_row:
      raise DataError(f"{record.where}: its images make {len(tiles)} tiles but a row holds "
                      f"train.tiles_per_row={self.tiles_per_row}")
    tokens = np.asarray(ids, np.int64)
    self._check_vocab(tokens, record.where)
    s = self.vision.image_size
    return Example(record.where, tokens.astype(np.int32), np.asarray(trained, bool),
                   np.stack(tiles) if tiles else np.zeros((0, s, s, 3), np.uint8),
                   np.asarray(starts, np.int32))

  def _text(self, text: str, where: str) -> list[int]:
    ids = self.tok.encode(text)
    if self.tok.ids["image"] in ids:  # it would stand for an image that is not there
      raise DataError(f"{where}: text contains the image placeholder "
                      f"{self.tok.template.image!r}; give images as image parts")
    return ids

  def _check_images_allowed(self, where: str) -> None:
    if not self.vision.enabled:
      raise DataError(f"{where}: record has an image but model.vision.enabled is false")
    if self.tiles_per_row == 0:
      raise DataError(f"{where}: record has an image but train.tiles_per_row is 0")

  def _check_vocab(self, tokens: np.ndarray, where: str) -> None:
    bad = tokens >= self.tok.vocab_size
    if bad.any():
      first = int(tokens[bad][0])
      raise DataError(f"{where}: token {self.tok.token_text(first)!r} has id {first}, outside "
                      f"the model vocabulary [0, {self.tok.vocab_size}) (model.vocab_size)")

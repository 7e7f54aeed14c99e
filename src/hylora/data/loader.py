"""The conversation data loader: grain reads and encodes records in a seeded shuffled
order (a new order every epoch), each host takes every `process_count`-th example of
that order, and examples are packed into rows in order.

Its position is one integer per host: the index, in this host's example stream, of the
first example no emitted row contains. `state()` returns it with the counters as plain
ints; `restore(state)` continues with exactly the next unseen example.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grain
import numpy as np

from hylora.core.config import Config
from hylora.data.chat import ChatTokenizer, find_tokenizer
from hylora.data.encode import ExampleEncoder
from hylora.data.example import Example, Skipped
from hylora.data.packing import Row
from hylora.data.records import RecordFile
from hylora.core.errors import ConfigError, DataError

log = logging.getLogger(__name__)


class ConversationLoader:

  def __init__(self, path: str, cfg: Config, *, process_index: int = 0, process_count: int = 1,
               threads: int = 4):
    tc, vision = cfg.train, cfg.model.vision
    if not 0 <= process_index < process_count:
      raise ConfigError(f"process index {process_index} is not in [0, {process_count})")
    self.seq_len, self.seed = tc.seq_len, tc.seed
    self.process_index, self.process_count = process_index, process_count
    self.with_images = vision.enabled and tc.tiles_per_row > 0
    self.row_shape = (tc.tiles_per_row, vision.image_size, vision.tokens_per_tile)
    tokenizer = ChatTokenizer(find_tokenizer(tc.tokenizer, path), tc.chat_template,
                              cfg.model.vocab_size)
    self.encoder = ExampleEncoder(tokenizer, vision, tc.tiles_per_row,
                                  Path(path).parent, tc.skip_bad_records)
    self.records = RecordFile(path)
    self._stream = (grain.MapDataset.source(self.records).shuffle(
        seed=tc.seed).repeat()[process_index::process_count].map(self.encoder))
    self._read = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=4 * threads)
    self.truncated = self.skipped = 0
    self._start(0)

  def _start(self, next_example: int) -> None:
    self.next_example = next_example
    self._iterator = iter(self._stream[next_example:].to_iter_dataset(self._read))
    self._pending: Example | None = None
    self._pending_cut = False

  def state(self) -> dict:
    """This host's position and counters (plain ints: saved with the checkpoint)."""
    return {
        "next_example": self.next_example,
        "truncated": self.truncated,
        "skipped": self.skipped,
        "process_index": self.process_index,
        "process_count": self.process_count,
        "seed": self.seed
    }

  def restore(self, state: dict) -> None:
    for key in ("process_index", "process_count", "seed"):
      if state.get(key) != getattr(self, key):
        raise ConfigError(f"data state: saved with {key}={state.get(key)}, this run has "
                          f"{getattr(self, key)}; the saved position does not apply")
    self.truncated, self.skipped = int(state["truncated"]), int(state["skipped"])
    self._start(int(state["next_example"]))

  @property
  def epoch(self) -> float:
    """Epochs of the whole file consumed, as seen from this host."""
    return self.next_example * self.process_count / len(self.records)

  def _peek(self) -> Example:
    while self._pending is None:
      item = next(self._iterator)
      if isinstance(item, Skipped):
        self.skipped += 1
        self.next_example += 1
        log.warning("skipped %s", item.reason)
        continue
      self._pending_cut = len(item) > self.seq_len  # counted once placed in a row
      if self._pending_cut:
        item = item.truncated(self.seq_len, self.row_shape[2])
      self._pending = item
    return self._pending

  def next_row(self) -> dict[str, np.ndarray]:
    row = Row(self.seq_len, *self.row_shape)
    while row.fits(self._peek()):
      row.add(self._pending)
      self.truncated += int(self._pending_cut)
      self._pending = None
      self.next_example += 1
    if row.segments == 0:  # unreachable: encode() bounds the tiles, truncation the length
      raise DataError(f"{self._pending.where}: the example fits no row")
    return row.arrays(self.with_images)

  def keep_rows(self, rows) -> None:
    """Nothing to do: this loader reads only this host's records (contiguous rows)."""
    del rows

  def summary(self) -> dict:
    return self.state()

  def next_batch(self, global_rows: int) -> dict[str, np.ndarray]:
    """This host's share of a global batch of `global_rows` rows."""
    if global_rows % self.process_count:
      raise ConfigError(f"train.batch_size: {global_rows} rows cannot be split evenly over "
                        f"{self.process_count} hosts")
    rows = [self.next_row() for _ in range(global_rows // self.process_count)]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

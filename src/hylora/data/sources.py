"""Training data: document sources packed into fixed-length rows with `segment_ids`.

A row holds whole documents back to back (a document longer than a row is cut into
row-sized pieces); `segment_ids` number the documents inside the row from 1 (0 marks
padding), `positions` restart at every document, and `labels` are the next token of
the same document (IGNORE_INDEX at document ends and on padding), so no token ever
attends to or predicts across a boundary.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterator

import numpy as np

from hylora.core.errors import DataError

IGNORE_INDEX = -100


@dataclasses.dataclass
class SyntheticSource:
  """Deterministic documents from a noisy affine bigram rule (learnable, never constant):
  next = (a * prev + c) mod vocab with probability 0.85, else uniform."""

  vocab_size: int
  seed: int
  min_len: int = 16
  max_len: int = 96

  def documents(self, start: int = 0) -> Iterator[np.ndarray]:
    index = start
    while True:
      rng = np.random.default_rng([self.seed, index])
      n = int(rng.integers(self.min_len, self.max_len + 1))
      doc = np.empty(n, np.int32)
      doc[0] = rng.integers(self.vocab_size)
      noise = rng.random(n) < 0.15
      rand = rng.integers(self.vocab_size, size=n)
      for t in range(1, n):
        doc[t] = rand[t] if noise[t] else (5 * doc[t - 1] + 3) % self.vocab_size
      yield doc
      index += 1


@dataclasses.dataclass
class TokenFileSource:
  """Documents from a `.jsonl` file (one JSON list of ids, or {"tokens": [...]}, per
  line) or a `.npy` file (2-D: one document per row; 1-D: one document), cycled."""

  path: str
  vocab_size: int

  def __post_init__(self):
    self._docs = list(self._read())
    if not self._docs:
      raise DataError(f"{self.path}: no documents found")

  def _read(self) -> Iterator[np.ndarray]:
    path = Path(self.path)
    if not path.exists():
      raise DataError(f"train.data: file {self.path} does not exist")
    if path.suffix == ".jsonl":
      with open(path) as f:
        for line_no, line in enumerate(f, 1):
          if not line.strip():
            continue
          try:
            item = json.loads(line)
          except json.JSONDecodeError as e:
            raise DataError(f"{self.path}:{line_no}: not valid JSON ({e.msg})") from None
          ids = item.get("tokens") if isinstance(item, dict) else item
          if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise DataError(f"{self.path}:{line_no}: expected a list of token ids or "
                            '{"tokens": [...]}')
          yield self._checked(np.asarray(ids, np.int64), f"{self.path}:{line_no}")
    elif path.suffix == ".npy":
      arr = np.load(path, allow_pickle=False)
      if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{self.path}: token ids must be integers, got dtype {arr.dtype}")
      rows = arr[None] if arr.ndim == 1 else arr
      if rows.ndim != 2:
        raise DataError(f"{self.path}: expected a 1-D or 2-D array, got shape {arr.shape}")
      for i, row in enumerate(rows):
        yield self._checked(row.astype(np.int64), f"{self.path}[row {i}]")
    else:
      raise DataError(f"train.data: {self.path}: unsupported file type (use .jsonl or .npy)")

  def _checked(self, ids: np.ndarray, where: str) -> np.ndarray:
    if ids.size == 0:
      raise DataError(f"{where}: empty document")
    bad = (ids < 0) | (ids >= self.vocab_size)
    if bad.any():
      first = int(ids[bad][0])
      raise DataError(f"{where}: token id {first} is outside the vocabulary "
                      f"[0, {self.vocab_size})")
    return ids.astype(np.int32)

  def documents(self, start: int = 0) -> Iterator[np.ndarray]:
    index = start
    while True:
      yield self._docs[index % len(self._docs)]
      index += 1


def make_source(data: str, vocab_size: int, seed: int, doc_lengths=(16, 96)):
  if data == "synthetic":
    return SyntheticSource(vocab_size, seed, *doc_lengths)
  return TokenFileSource(data, vocab_size)


class Packer:
  """Packs a source's documents into rows; `position` (documents consumed, plus the
  offset inside a document cut across rows) makes the stream resumable."""

  def __init__(self, source, seq_len: int, position: tuple[int, int] = (0, 0)):
    self.source, self.seq_len = source, seq_len
    self.doc_index, self.doc_offset = position
    self._docs = source.documents(self.doc_index)
    self._current = None

  @property
  def position(self) -> tuple[int, int]:
    return self.doc_index, self.doc_offset

  def _peek(self) -> np.ndarray:
    if self._current is None:
      self._current = next(self._docs)
    return self._current[self.doc_offset:]

  def next_row(self) -> dict[str, np.ndarray]:
    t = self.seq_len
    tokens = np.zeros(t, np.int32)
    segments = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    fill, segment = 0, 0
    while fill < t:
      rest = self._peek()
      if fill > 0 and len(rest) > t - fill and len(rest) <= t:
        break  # a document that fits a whole row is not split: start it on the next row
      take = min(len(rest), t - fill)
      segment += 1
      tokens[fill:fill + take] = rest[:take]
      segments[fill:fill + take] = segment
      positions[fill:fill + take] = np.arange(take) + self.doc_offset
      fill += take
      if take == len(rest):
        self.doc_index, self.doc_offset, self._current = self.doc_index + 1, 0, None
      else:
        self.doc_offset += take
    labels = np.full(t, IGNORE_INDEX, np.int32)
    same = (segments[1:] == segments[:-1]) & (segments[1:] > 0)
    labels[:-1] = np.where(same, tokens[1:], IGNORE_INDEX)
    return {"tokens": tokens, "labels": labels, "segment_ids": segments, "positions": positions}

  def next_batch(self, rows: int) -> dict[str, np.ndarray]:
    items = [self.next_row() for _ in range(rows)]
    return {k: np.stack([it[k] for it in items]) for k in items[0]}

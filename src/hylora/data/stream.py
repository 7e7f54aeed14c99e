"""The run's data: one stream, whatever the source.

`open_stream(cfg)` reads `train.data`: conversation / plain-text JSONL through the
`ConversationLoader` (each process reads its own share of the records), token files and
the synthetic source through the `Packer` (every process packs the same global batch and
keeps its rows). Either way `next_batch(global_rows)` returns this process's rows of the
global batch, `state()` / `summary()` say where the stream stands, and `io.checkpoint`
saves and restores that position.
"""

from __future__ import annotations

import jax
import numpy as np

from hylora.core.config import Config
from hylora.data.loader import ConversationLoader
from hylora.data.records import is_conversation_file
from hylora.data.sources import Packer, make_source


class TokenStream:
  """Token documents packed into rows (`Packer`); `local_rows` picks this process's rows
  of every global batch (all of them until `keep_rows` is told which)."""

  def __init__(self, packer: Packer, local_rows=None):
    self.packer = packer
    self.local_rows = local_rows

  def keep_rows(self, rows) -> None:
    self.local_rows = rows

  @property
  def position(self) -> tuple[int, int]:
    return self.packer.position

  def resumed_at(self, position) -> "TokenStream":
    """The same stream continued from a saved `position`."""
    packer = Packer(self.packer.source, self.packer.seq_len, tuple(position))
    return TokenStream(packer, self.local_rows)

  def next_batch(self, global_rows: int) -> dict[str, np.ndarray]:
    batch = self.packer.next_batch(global_rows)
    if self.local_rows is None:
      return batch
    return {k: v[self.local_rows] for k, v in batch.items()}

  def summary(self) -> dict:
    return {"documents_read": self.position[0]}


def open_stream(cfg: Config):
  """The stream `train.data` names (a TokenStream or a ConversationLoader)."""
  tc = cfg.train
  if is_conversation_file(tc.data):
    return ConversationLoader(tc.data, cfg, process_index=jax.process_index(),
                              process_count=jax.process_count())
  return TokenStream(
      Packer(make_source(tc.data, cfg.model.vocab_size, tc.seed, tc.synthetic_docs), tc.seq_len))

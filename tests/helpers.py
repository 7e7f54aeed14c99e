"""Small configurations shared by the tests."""

from __future__ import annotations

import dataclasses

from hylora.config import Config, MeshConfig
from hylora.presets import tiny


def small_config(**train) -> Config:
  """The tiny preset cut to one `L L L S` period (one dense layer), short rows."""
  cfg = tiny()
  model = dataclasses.replace(cfg.model, layers=4, dense_layers=1)
  return dataclasses.replace(
      cfg, model=model, mesh=MeshConfig(fsdp=2, expert=4),
      train=dataclasses.replace(cfg.train, seq_len=64, batch_size=8, **train))

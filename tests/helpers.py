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


def two_layer_config(**train) -> Config:
  """small_config() with one layer of each kind: linear attention with the dense FFN,
  sparse attention with the MoE. Half the compile, for tests whose property does not
  depend on depth (tests/cli_runs.py runs the command on it)."""
  cfg = small_config(**train)
  return dataclasses.replace(cfg, model=dataclasses.replace(
      cfg.model, layers=2, pattern=("linear", "sparse"), dense_layers=1))

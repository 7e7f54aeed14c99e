"""The 2p8t plan's per-device state from abstract shapes and the sharding rules alone
(no devices, no compile): every large array over both mesh axes, LoRA state ~1.4 GB."""

from __future__ import annotations

import dataclasses
import math

import jax
import pytest
from flax import nnx

from hylora.plan.dry_run_setup import dry_run_config, dry_run_target
from hylora.plan.save_point_sizes import tokens_per_device
from hylora.core.presets import get_preset
from hylora.train import state as st
from meshes.rules import PARAM_RULES, logical_to_spec

MESH = {"fsdp": 2, "expert": 64}


class _Mesh:
  shape = MESH


def _per_device(template):
  """[(path, shape, shards)] of every variable of an abstract nnx.State on the 2 x 64 mesh."""
  out = []
  leaves = jax.tree_util.tree_flatten_with_path(template,
                                                is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
  for path, var in leaves:
    spec = logical_to_spec(var.get_metadata().get("out_sharding"), var.shape, _Mesh, PARAM_RULES)
    shards = math.prod(MESH[a] for entry in spec if entry is not None
                       for a in ((entry,) if isinstance(entry, str) else entry))
    out.append((jax.tree_util.keystr(path), tuple(var.shape), shards))
  return out


@pytest.fixture(scope="module")
def parts():
  return st.model_parts(get_preset("2p8t"))


def test_lora_state_is_about_1p4_gb_per_device(parts):
  rows = _per_device(parts.lora_template)
  params = sum(math.prod(shape) * 4 // shards for _, shape, shards in rows)  # fp32
  state = 4 * params  # params + grads + two Adam moments
  assert 1.3e9 < state < 1.5e9, state / 1e9
  for path, shape, shards in rows:  # every large factor over both axes
    if math.prod(shape[1:]) >= 1 << 20:
      assert shards == 128, (path, shape, shards)


def test_base_weights_are_about_43p5_gb_per_device(parts):
  rows = _per_device(parts.frozen_template)
  weights = sum(math.prod(shape) * 2 // shards for _, shape, shards in rows)  # bf16
  assert weights == pytest.approx(43.5e9, rel=0.01)


def test_planner_counts_the_tokens_the_dry_run_shards():
  cfg = get_preset("2p8t")  # 64 rows x 32768 on 2 x 64: a row per expert group, halved
  assert tokens_per_device(cfg, (2, 64)) == 16384


def test_a_dry_run_changes_nothing_but_the_simulated_device_count():
  cfg = get_preset("2p8t")
  assert dry_run_target(cfg) == "gpu" and dry_run_target(get_preset("tiny")) == "cpu"
  assert dry_run_config(cfg) == dataclasses.replace(cfg,
                                                    mesh=dataclasses.replace(cfg.mesh, devices=128))

"""The planner's working set from compiled layer parts (hylora.plan.part_memory)."""

import dataclasses

import pytest

from hylora.plan import part_memory
from hylora.core.config import MemoryConfig
from hylora.plan.remat_planner import estimate_policy, plan_memory
from hylora.plan.save_point_sizes import tokens_per_device
from hylora.core.presets import tiny

MESH = (1, 1)


@pytest.fixture(scope="module")
def cfg():
  c = tiny()
  return dataclasses.replace(c, train=dataclasses.replace(c.train, seq_len=64, batch_size=2))


def test_measured_working_set_is_the_largest_layer_of_compiled_parts(cfg):
  tokens = tokens_per_device(cfg, MESH)
  parts = {
      p: part_memory.part_temp_bytes(cfg, p, tokens) for p in ("linear", "sparse", "moe", "dense")
  }
  assert all(v > 0 for v in parts.values())
  kinds = set(cfg.model.layer_kinds())
  want = max(parts[m] + parts[f] for m, f in kinds)
  assert part_memory.measured_working_bytes(cfg, tokens) == want


def test_a_measured_working_set_replaces_the_estimate_in_the_peak(cfg):
  full = MemoryConfig(remat="full")
  analytic = estimate_policy(cfg, MESH, 1e12, full)
  measured = estimate_policy(cfg, MESH, 1e12, full, working_bytes=10 * analytic.working_bytes)
  assert not analytic.working_compiled and measured.working_compiled
  stream = measured.working_bytes - 10 * analytic.working_bytes
  assert 0 < stream < analytic.working_bytes  # the stream's cotangents are added to both
  assert (measured.predicted_peak_bytes - analytic.predicted_peak_bytes == measured.working_bytes -
          analytic.working_bytes)
  assert "working set of one layer (compiled)" in measured.table()


def test_a_larger_working_set_leaves_less_saved_in_hbm(cfg):
  full = estimate_policy(cfg, MESH, 1e12, MemoryConfig(remat="full"))
  none = estimate_policy(cfg, MESH, 1e12, MemoryConfig(remat="none"))
  budget = (full.predicted_peak_bytes + none.predicted_peak_bytes) / 2
  small = plan_memory(cfg, MESH, budget)
  big = plan_memory(cfg, MESH, budget, working_bytes=small.working_bytes * 2)
  assert small.fits and big.fits
  assert big.saved_hbm_bytes < small.saved_hbm_bytes
  assert big.predicted_step_seconds >= small.predicted_step_seconds


def test_unknown_part_is_named():
  with pytest.raises(ValueError, match="unknown 'attention'"):
    part_memory.part_temp_bytes(tiny(), "attention", 64)

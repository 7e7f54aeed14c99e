"""The run's plan: resolved once from the configuration and the devices, the same for a
dry run and the run it stands for, down to the program XLA is given."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import pytest

import cli_runs
from hylora.core.config import MeshConfig
from hylora.core.overrides import apply_overrides
from hylora.core.presets import get_preset
from hylora.plan.run_plan import PLAN_FILE, resolve
from hylora.train.mesh import run_mesh
from tests.helpers import small_config


def _plan(cfg, devices=None, **kw):
  return resolve(cfg, run_mesh(cfg.mesh, devices), **kw)


def test_auto_dispatch_is_expert_parallel_on_a_mesh_and_dropless_on_one_device():
  cfg = apply_overrides(small_config(), {"model.moe.dispatch": "auto"})
  plan = _plan(cfg)
  assert plan.experts.dispatcher == "ep_alltoall" and not plan.experts.drops
  assert plan.apply(cfg).model.moe.dispatch == "ep_alltoall"
  # rows per round: 1.25 x the mean rows a device sends one rank (64 tokens x top-2 / 4)
  assert plan.experts.rows_per_round == 40
  assert {o.op: o.per_device for o in plan.ops}["grouped_matmul"] == "inside ep_alltoall"
  one = _plan(apply_overrides(cfg, {"mesh.expert": "1", "mesh.fsdp": "1"}), jax.devices()[:1])
  assert one.experts.dispatcher == "dropless" and one.experts.buffer_bytes == 0
  dropping = _plan(apply_overrides(cfg, {"model.moe.capacity_factor": "1.5"}))
  assert dropping.experts.drops and "drops rows over" in dropping.text()


def test_auto_remat_is_the_planners_policy_and_a_named_policy_stays():
  cfg = small_config()
  plan = _plan(cfg)
  assert plan.memory.planned and plan.memory.policy == "tiered" and plan.memory.fits
  # the planner fills the budget less its headroom (what its model does not count)
  assert plan.memory.planned_for == pytest.approx(0.93 * plan.memory.device_memory)
  assert plan.memory.predicted_peak <= plan.memory.planned_for
  resolved = plan.apply(cfg)
  assert resolved.memory.remat == "tiered" and resolved.memory.hbm_names == plan.memory.hbm_names
  tight = _plan(apply_overrides(cfg, {"memory.device_memory": "2e6"}))
  assert len(tight.memory.hbm_names) < len(plan.memory.hbm_names)  # a smaller budget keeps less
  full = _plan(apply_overrides(cfg, {"memory.remat": "full"}))
  assert not full.memory.planned and full.apply(cfg).memory.remat == "full"


def test_the_plan_names_the_kernels_the_model_calls_and_their_stand_ins():
  cfg = small_config()
  plan = _plan(cfg, target="gpu")
  ops = {o.op: o for o in plan.ops}
  assert set(ops) == {
      "cross_entropy", "grouped_lora", "grouped_matmul", "linear_attention.kda",
      "sparse_attention.attend", "sparse_attention.topk_indices"
  }
  assert ops["grouped_matmul"].implementation == "mosaic"
  assert ops["grouped_matmul"].compiled_as == "loop"  # the Mosaic kernel's memory on CPU
  assert ops["linear_attention.kda"].per_device == "linear_recurrence"
  assert "grouped_matmul: loop stands in for mosaic on cpu" in plan.stand_ins()
  assert plan.apply(cfg).kernels.grouped_matmul == "loop"
  named = apply_overrides(cfg, {"kernels.grouped_matmul": "reference"})
  assert _plan(named, target="gpu").apply(named).kernels.grouped_matmul == "reference"
  here = _plan(cfg)  # a CPU run: nothing stands in
  assert here.target == "cpu" and not here.stand_ins()
  assert here.apply(cfg).kernels == cfg.kernels


def test_a_plan_round_trips_through_its_file(tmp_path):
  plan = _plan(small_config())
  path = plan.write(tmp_path)
  assert path.name == PLAN_FILE and json.loads(path.read_text()) == json.loads(
      json.dumps(dataclasses.asdict(plan)))


def test_the_2p8t_plan_is_expert_parallel_dropless_with_bounded_buffers():
  cfg = get_preset("2p8t")
  from hylora.plan.run_plan import expert_plan
  plan = expert_plan(cfg, {"fsdp": 2, "expert": 64}, 128)
  assert plan.dispatcher == "ep_alltoall" and not plan.drops
  # 16384 tokens x top-16 per device over 64 ranks: 4096 rows a rank on average, 5120 a round
  assert plan.rows_per_round == 5120
  # a backward round: rows and cotangents out, gradients back, the experts' intermediates
  # first round 5120 rows a rank, later ones 1024; worst-case sizing took 53.8 TB
  assert plan.buffer_bytes == 64 * (5120 + 1024) * (6 * 7168 + 3 * 2048) * 2


def test_the_dry_run_compiles_the_program_the_run_runs():
  reference = cli_runs.reference_run()  # tests/cli_runs.py: one process, 8 devices
  summary = json.loads((reference / "summary.json").read_text())
  run_plan = json.loads((reference / PLAN_FILE).read_text())
  report = reference.parent / "dry-run-of-reference.json"
  done = subprocess.run(
      cli_runs.command("--preset", "tiny", "--dry-run", "--steps", str(cli_runs.STEPS), "--json",
                       str(report)), cwd=cli_runs.ROOT, env=cli_runs.env(), capture_output=True,
      text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  dry = json.loads(report.read_text())
  assert dry["plan"] == run_plan
  assert dry["program_fingerprint"] == summary["program_fingerprint"] != ""
  assert done.stdout.startswith(dry["plan_text"])
  assert not dry["stand_ins"]  # a CPU preset: its dry run is its run


def test_the_main_command_checks_every_value_before_it_starts(tmp_path):
  bad = subprocess.run([
      sys.executable, "-m", "experiments.lora_2p8t", "--model.moe.dispatch=bogus", "--out",
      str(tmp_path / "never")
  ], cwd=cli_runs.ROOT, env=cli_runs.env(), capture_output=True, text=True, timeout=300)
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines() == [
      "error: model.moe.dispatch: unknown dispatcher 'bogus'; choose one of "
      "['auto', 'dropless', 'ep_alltoall']"
  ]
  assert not (tmp_path / "never").exists()


def test_a_fixed_mesh_smaller_than_the_host_is_printed_and_too_large_is_one_line():
  cfg = dataclasses.replace(small_config(), mesh=MeshConfig(fsdp=1, expert=2))
  assert _plan(cfg).devices == 2
  with pytest.raises(Exception, match="asks for 16 devices, this host has 8 cpu"):
    run_mesh(MeshConfig(fsdp=4, expert=4))


@pytest.mark.parametrize("batch, seq, axes, ranks, rounds", [
    (1, 1048576, ("fsdp", "expert"), 128, 7),
    (4, 262144, ("expert",), 64, 6),
    (64, 32768, ("fsdp",), 2, 1),
    (128, 8192, None, 1, 0),
])
def test_the_sequence_takes_the_axes_the_batch_leaves(batch, seq, axes, ranks, rounds):
  from hylora.plan.context_plan import context_plan
  cfg = apply_overrides(get_preset("2p8t"), {
      "train.batch_size": str(batch),
      "train.seq_len": str(seq)
  })
  plan = context_plan(cfg, {"fsdp": 2, "expert": 64})
  if axes is None:
    assert plan is None  # whole sequences on every device
    return
  assert (plan.axes, plan.ranks, plan.scan_rounds) == (axes, ranks, rounds)
  assert plan.tokens_per_rank * ranks == seq
  assert dict(plan.schemes) == {"linear": "state scan over ranks", "sparse": "gathered keys"}
  assert f"{ranks} ranges of {seq // ranks} tokens" in plan.text()

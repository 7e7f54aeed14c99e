"""The dry run: the real step compiled for 128 simulated devices from abstract shapes.

The test process owns 8 simulated devices (conftest.py), so every 128-device dry run is
a subprocess of the command itself; the full-size 2p8t counts are read in-process from
abstract shapes (no device, no compile)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hylora.plan import param_count
from hylora.core.presets import get_preset
from hylora.train import state as st

ROOT = Path(__file__).resolve().parents[1]

# The reduced-depth variant: 2p8t widths, 896 experts, top-16, one 4-layer period
# (2 dense + 2 MoE layers), the default plan. Short rows keep the compile CI-sized: the
# argument bytes, counts and shardings checked here do not depend on them.
REDUCED = ["--model.layers=4", "--train.batch_size=128", "--train.seq_len=64"]


def _command(*args: str) -> subprocess.Popen:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the command sets its own
  return subprocess.Popen([sys.executable, "-m", "experiments.lora_2p8t", "--dry-run", *args],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def _finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
  out, err = proc.communicate(timeout=timeout)
  return proc.returncode, out, err


BAD_INPUTS = [
    (["--devices", "64"], 2, "mesh: fsdp=2 x expert=64 = 128 devices, but only 64"),
    (["--devices", "96", "--mesh.fsdp=2", "--mesh.expert=48"], 2,
     "896 experts cannot be split evenly over the expert mesh axis of size 48"),
    (["--device-memory", "20GB"], 1, "--device-memory: 20.0 GB per device cannot hold"),
    (["--device-memory", "lots"], 2, "--device-memory: expected a positive size"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The reduced-depth compile and the bad-input runs, started side by side."""
  path = tmp_path_factory.mktemp("dry") / "reduced.json"
  compile_proc = _command(*REDUCED, "--json", str(path))
  bad = [_command("--no-compile", *args) for args, _, _ in BAD_INPUTS]
  bad_results = [_finish(proc, timeout=600) for proc in bad]
  rc, out, err = _finish(compile_proc)
  assert rc == 0, out + err
  return (json.loads(path.read_text()), out), bad_results


@pytest.fixture(scope="module")
def reduced(runs):
  return runs[0]


def _expected_by_kind(cfg) -> dict:
  """Parameter counts per kind from the architecture's arithmetic (docs/target_model.md)."""
  m, la, sa, moe, r = (cfg.model, cfg.model.linear_attention, cfg.model.sparse_attention,
                       cfg.model.moe, cfg.lora.rank)
  d = m.d_model
  kinds = m.layer_kinds()
  lin = sum(mixer == "linear" for mixer, _ in kinds)
  sparse = len(kinds) - lin
  dense = sum(ffn == "dense" for _, ffn in kinds)
  moe_layers = len(kinds) - dense
  h = la.heads * la.head_dim
  linear_attn = (4 * d * h + d * la.gate_rank + la.gate_rank * h + d * la.output_gate_rank +
                 la.output_gate_rank * h + d * la.heads)
  q, kv = sa.q_heads * sa.head_dim, sa.kv_heads * sa.head_dim
  sparse_attn = (2 * d * q + 2 * d * kv + d * sa.index_q_rank +
                 sa.index_q_rank * sa.index_heads * sa.index_head_dim + d * sa.index_head_dim +
                 d * sa.index_heads)
  f, e, shared_f = moe.expert_ffn, moe.experts, moe.expert_ffn * moe.shared_experts
  experts = moe_layers * e * 3 * d * f
  return {
      "experts": {
          "total": experts,
          "active": experts * moe.top_k // e,
          "lora": moe_layers * e * r * (d + 2 * f)
      },
      "shared_experts": {
          "total": moe_layers * 3 * d * shared_f,
          "lora": moe_layers * r * (d + 2 * shared_f)
      },
      "dense_ffn": {
          "total": dense * 3 * d * m.dense_ffn,
          "lora": dense * r * (d + 2 * m.dense_ffn)
      },
      "attention": {
          "total": lin * linear_attn + sparse * sparse_attn,
          "lora": lin * r * 4 * (d + h) + sparse * r * (2 * (d + q) + 2 * (d + kv))
      },
      "router": {
          "total": moe_layers * (d * e + e),
          "lora": 0
      },
      "norms": {
          "total": len(kinds) * 2 * d + lin * la.head_dim + d,
          "lora": 0
      },
      "embeddings": {
          "total": 2 * m.vocab_size * d,
          "active": m.vocab_size * d,
          "lora": 0
      },
  }


def _reduced_config():
  cfg = get_preset("2p8t")
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, layers=4))


def test_counts_per_kind_match_the_architecture(reduced):
  report, _ = reduced
  got = report["params_by_kind"]
  for kind, want in _expected_by_kind(_reduced_config()).items():
    assert got[kind]["total"] == want["total"], kind
    assert got[kind]["lora"] == want["lora"], kind
    assert got[kind]["active"] == want.get("active", want["total"]), kind
  assert got["vision"]["total"] > 0 and got["vision"]["active"] == 0
  assert report["params_total"] == sum(k["total"] for k in got.values())
  assert report["params_lora"] == sum(k["lora"] for k in got.values())


def test_experts_split_64_ways_and_everything_large_over_both_axes(reduced):
  report, _ = reduced
  assert report["devices"] == 128 and report["mesh"] == {"fsdp": 2, "expert": 64}
  experts = [a for a in report["arrays"] if a["kind"] == "experts"]
  assert len(experts) == 8  # gate_up, down, lora_a, lora_b of the two MoE layers
  for a in experts:
    # [layers, experts, ...]: the expert dimension on the expert axis, 14 per device,
    # and the weight itself over fsdp inside the group.
    assert a["spec"].split(", ")[1] == "expert", a["path"]
    assert a["shard_shape"][1] == 896 // 64 == 14, a["path"]
    assert a["mesh_axes"] == ["expert", "fsdp"], a["path"]
  large = [a for a in report["arrays"] if a["large"] and a["kind"] != "experts"]
  assert len(large) > 20
  for a in large:
    assert a["mesh_axes"] == ["expert", "fsdp"], (a["path"], a["spec"])
    assert a["split"] == 128, a["path"]


def test_argument_bytes_match_the_analytic_figure(reduced):
  report, out = reduced
  b = report["bytes_per_device"]
  assert abs(b["xla_arguments"] - b["analytic_arguments"]) <= 0.02 * b["analytic_arguments"]
  assert b["xla_peak"] == (b["xla_arguments"] + b["xla_outputs"] - b["xla_aliased"] +
                           b["xla_temporaries"])
  assert report["fits"] == (b["xla_peak"] <= report["device_memory"])
  assert report["compile_seconds"] > 0 and report["step"]["dispatch"] == "ep_alltoall"
  assert report["partitioner_replications"] == []
  for key in ("params_total", "params_active_per_token", "params_lora", "devices", "mesh",
              "bytes_per_device", "compile_seconds", "device_memory", "fits"):
    assert key in report
  for key in ("weights", "lora", "grads", "optimizer", "xla_arguments", "xla_temporaries",
              "xla_peak"):
    assert key in b
  assert "verdict: fits" in out and "peak host memory" in out


def test_the_dry_run_compiles_the_default_plan_and_names_its_stand_ins(reduced):
  report, out = reduced
  plan, step = report["plan"], report["step"]
  assert out.startswith(report["plan_text"])  # printed first, as the run prints it
  assert plan["target"] == "gpu" and plan["compiled_on"] == "cpu"
  experts = plan["experts"]
  assert experts["dispatcher"] == step["dispatch"] == "ep_alltoall"
  assert not experts["drops"] and step["capacity_factor"] == 0  # dropless, in rounds
  assert 0 < experts["rows_per_round"] and 0 < experts["buffer_bytes"] < 2e9
  assert plan["memory"]["planned"] and step["remat"] == plan["memory"]["policy"]
  impls = report["implementations"]
  assert impls["grouped_matmul"] == impls["grouped_lora"] == "mosaic"  # the GPU's kernels
  assert "grouped_matmul: loop stands in for mosaic on cpu" in report["stand_ins"]
  assert "stand-in on XLA:CPU: grouped_matmul: loop stands in for mosaic on cpu" in out
  # the planner counts the tokens the batch sharding gives each device
  assert step["micro_batch_tokens_per_device"] * step["grad_accum"] == step["tokens_per_device"]
  assert report["memory_plan"]["best_plan"].count(f"{step['tokens_per_device']} tokens") == 1


def test_full_2p8t_counts_from_abstract_shapes():
  cfg = get_preset("2p8t")
  lora, frozen = st.abstract_arrays(st.model_parts(cfg))
  counts = param_count.count_params(cfg, lora, frozen)
  assert counts["total"] == pytest.approx(2.785e12, rel=0.01)
  assert counts["active"] == pytest.approx(7.06e10, rel=0.02)
  assert counts["lora"] == pytest.approx(1.14e10, rel=0.02)
  assert counts["by_kind"]["experts"]["total"] == pytest.approx(2.762e12, rel=0.01)
  assert counts["by_kind"]["attention"]["total"] == pytest.approx(1.575e10, rel=0.01)


def test_bad_input_is_one_line_and_a_nonzero_exit(runs):
  for (rc, out, err), (args, code, message) in zip(runs[1], BAD_INPUTS):
    assert rc == code, (args, out + err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (args, err)


def test_sweep_varies_one_factor_at_a_time():
  from hylora.plan.dry_run import sweep_variants
  cfg = get_preset("2p8t")
  variants = dict(sweep_variants(cfg))
  assert list(variants) == [
      "base", "seq/4", "seq/2", "batch/2", "remat=full", "remat=minimal", "remat=none"
  ]  # the base: the planner's policy (memory.remat=auto)
  assert variants["seq/4"].train.seq_len == 8192 and variants["seq/4"].train.batch_size == 64
  assert variants["batch/2"].train.batch_size == 32 and variants["batch/2"].train.seq_len == 32768
  assert variants["remat=none"].memory.remat == "none"


def test_sizes_and_compiled_program_parsing():
  from hylora.plan.compiled_program import involuntary_replications, largest_values
  from hylora.plan.dry_run import parse_bytes
  assert parse_bytes("141GB") == 141e9 and parse_bytes("2 GiB") == 2 * 2**30
  assert parse_bytes("80") == 80e9
  hlo = "\n".join([
      "%fused_computation.1 (p: f32[8,8]) -> f32[1024,1024] {",
      "  %inner = f32[1024,1024]{1,0} broadcast(%p)",  # inside a fusion: never materialised
      "}",
      "ENTRY %main (a: bf16[4,4]) -> f32[16,16] {",
      "  %a = bf16[4,4]{1,0} parameter(0)",
      '  %fusion.2 = f32[16,16]{1,0} fusion(%a), kind=kLoop, metadata={op_name="jit(step)/dot"}',
      "  %copy.3 = bf16[2,2]{1,0} copy(%a)",
      "}"
  ])
  values = largest_values(hlo)
  assert [v["shape"] for v in values] == ["f32[16,16]", "bf16[2,2]"]
  assert values[0]["bytes"] == 1024 and values[0]["source"] == "jit(step)/dot"
  log = ("W spmd_partitioner.cc:661] [SPMD] Involuntary full rematerialization. The compiler "
         "cannot go from sharding {a} to {b} efficiently for HLO operation %scatter = "
         "bf16[2097152,3584]{1,0} scatter(%x)\n") * 2
  assert involuntary_replications(log) == [{"shape": "bf16[2097152,3584]", "count": 2}]

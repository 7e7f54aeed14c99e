"""experiments.bench_multi_gpu: one `--small` run on 8 simulated CPU devices over both
meshes (in a subprocess: the script sets its own XLA flags), checked against the shapes it
was given; bad input exits 2 naming the problem."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import bench_multi_gpu, bench_step
from hylora.core.presets import tiny

ROOT = Path(__file__).resolve().parents[1]


def _run_small(tmp_path) -> tuple[dict, str]:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = tmp_path / "report.json"
  done = subprocess.run([
      sys.executable, "-m", "experiments.bench_multi_gpu", "--small", "--pgle", "--json",
      str(out)
  ], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(out.read_text()), done.stdout


def test_small_run_reports_both_meshes(tmp_path):
  report, stdout = _run_small(tmp_path)
  assert report["devices"] == 8 and report["small"]
  assert list(report["meshes"]) == ["1x8", "2x4"]
  m = tiny().model
  d, k = m.d_model, m.moe.top_k
  tokens_per_gpu = 64  # 8 rows x 64 tokens over 8 devices
  pairs = tokens_per_gpu * k
  runs = bench_multi_gpu.configs(bench_multi_gpu._args(["--small"]))
  for name, r in report["meshes"].items():
    fsdp, expert = map(int, name.split("x"))
    assert r["mesh"] == {"fsdp": fsdp, "expert": expert}

    t = r["transport"]
    assert (t["ranks"], t["tokens_per_gpu"], t["pairs_per_gpu"]) == (expert, tokens_per_gpu, pairs)
    # dropless (capacity factor 0): C = all of a device's pairs; bf16 [R, C, d] per GPU
    assert t["capacity"] == pairs and t["dropped_fraction"] == 0.0
    assert t["padded"]["bytes_per_gpu"] == expert * pairs * d * 2
    assert t["all_to_all"]["bytes_per_gpu"] == t["padded"]["bytes_per_gpu"]
    for leg in (t["padded"]["dispatch"], t["padded"]["combine"], t["all_to_all"]):
      assert leg["ms"] > 0
      assert leg["gbps"] == pytest.approx(expert * pairs * d * 2 / leg["ms"] / 1e6, rel=5e-3)
    assert t["padded"]["dispatch"]["of_plain"] > 0
    skipped = t["ragged"]["skipped"]
    assert "ragged_all_to_all" in skipped and "'cpu'" in skipped

    layer = r["moe_layer"]
    assert (layer["experts"], layer["tokens"]) == (2 * expert, 8 * 64)
    assert list(layer["chunks"]) == ["1", "2"]
    assert all(
        c["fwd_bwd_ms"] > 0 and c["dropped_fraction"] == 0.0 for c in layer["chunks"].values())
    two = layer["chunks"]["2"]  # no drops: the chunked pipeline computes the same numbers
    assert two["matches_first"] and two["max_rel_diff"] < 1e-5 and two["speedup"] > 0
    # each chunk has its own all-to-alls; XLA:CPU runs collectives synchronously
    one_sched, two_sched = layer["chunks"]["1"]["schedule"], two["schedule"]
    assert 0 < one_sched["count"] < two_sched["count"]
    assert one_sched["asynchronous"] == two_sched["asynchronous"] == 0
    # --pgle: XLA:CPU records no per-instruction device times, so nothing is recompiled
    assert all(
        not c["pgle"]["profiled"] and c["pgle"]["fwd_bwd_ms"] > 0 for c in layer["chunks"].values())

    step = r["train_step"]
    cfg = runs[name][0]
    assert math.isfinite(step["final_loss"]) and step["final_loss"] > 0
    assert step["tokens_per_s_per_gpu"] == pytest.approx(512 / step["step_seconds"] / 8)
    flops = sum(bench_step.flops_per_step(cfg).values()) / 8
    assert step["model_flops_per_gpu"] == pytest.approx(flops)
    assert step["mfu"] == pytest.approx(flops / step["step_seconds"] / report["peak_flops"])
  assert stdout.count("skipped: model.moe.transport") == 2
  assert "mesh 2x4: top-2" in stdout and "  64 tokens/GPU, capacity 128 rows" in stdout
  assert "MoE layer (8 experts) fwd+bwd: 1 chunk(s)" in stdout


@pytest.mark.parametrize("argv,message", [
    (["--mesh", "3x2"], "mesh: fsdp=3 x expert=2 = 6 devices, but 8 are present"),
    (["--mesh", "1y8"], "--mesh: '1y8' is not FSDPxEXPERT"),
    (["--chunks", "3"], "do not split into 8 devices x 3 chunks"),
    (["--model.moe.nope=1"], "unknown config field 'model.moe.nope'"),
    (["--mock-gpus", "8"], "use it with --schedule-only"),
])
def test_bad_input_exits_2(argv, message, capsys):
  assert bench_multi_gpu.main(argv) == 2
  assert message in capsys.readouterr().err


def test_schedule_only_compiles_every_chunk_count_and_writes_the_hlo(tmp_path):
  args = bench_multi_gpu._args(["--small", "--mesh", "2x4", "--schedule-only"])
  cfg, mesh = bench_multi_gpu.configs(args)["2x4"]
  rows = bench_multi_gpu.schedule_layer(cfg, mesh, [1, 2], str(tmp_path))
  assert list(rows) == ["1", "2"] and rows["1"]["count"] < rows["2"]["count"]
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      "moe_layer_2x4_chunks1.hlo.txt", "moe_layer_2x4_chunks2.hlo.txt"
  ]
  assert "all-to-all" in (tmp_path / "moe_layer_2x4_chunks2.hlo.txt").read_text()

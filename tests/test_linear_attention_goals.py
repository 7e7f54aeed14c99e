"""The goal table reads the benchmark's rows: the best setting of ours per pass by its
median per-round ratio to the peer, and whether both passes reach the goal."""
import json
import time

import pytest

from experiments import linear_attention_goals as goals
from experiments.timing import interleaved_ratios


def _sleeper(seconds):
  return lambda: time.sleep(seconds)


def _row(op, gates, fwd_ours, bwd_ours, peer=0.01):
  """A row as bench_linear_attention prints it, from real alternating rounds of sleeps."""
  row = {"op": op, "shape": [1, 64, 2, 16], "gates": gates, "layouts": {}}
  for kind, ours in (("fwd", fwd_ours), ("fwdbwd", bwd_ours)):
    row[f"vs_jla_{kind}"] = interleaved_ratios({
        name: _sleeper(s) for name, s in ours.items()
    }, _sleeper(peer), rounds=3, calls=1)
  return row


def test_best_setting_per_pass_and_the_goal(tmp_path, capsys):
  fast, slow = 0.001, 0.03  # 10x and 1/3 of the peer: far from 1 on a busy machine
  rows = [
      _row("kda", "kda_init", {
          "a": slow,
          "b": fast
      }, {
          "a": fast,
          "b": slow
      }),
      _row("gla", "logsigmoid", {"a": slow}, {"a": fast}),
      {
          "op": "gla",
          "shape": [1, 64, 2, 16],
          "gates": "logsigmoid_strong",
          "jla": "missing: x"
      },
      {
          "shape": [1, 64, 2, 16],
          "gates": "logsigmoid",
          "kernel_ms": {}
      },  # a breakdown
  ]
  path = tmp_path / "bench.jsonl"
  path.write_text("[CpuDevice(id=0)]\n" + "\n".join(map(json.dumps, rows)) + '\n{"cut')
  lines = [ln for row in goals.read_rows([str(path)]) if (ln := goals.summarize(row, "jla", 1.0))]
  assert len(lines) == 3
  kda, gla, missing = lines
  assert (kda["fwd"]["setting"], kda["fwdbwd"]["setting"]) == ("b", "a") and kda["met"]
  assert kda["fwd"]["ratio"] > 1 and kda["fwd"]["peer_ms"] > kda["fwd"]["ours_ms"]
  assert gla["fwd"]["ratio"] < 1 and not gla["met"]
  assert missing["note"] == "jla: missing: x"
  goals.main([str(path)])
  out = capsys.readouterr().out
  assert "| kda | kda_init | 1,64,2,16 |" in out and "1 of 3 lines reach 1x jla" in out


def test_a_file_without_rows_is_one_line_naming_it(tmp_path):
  path = tmp_path / "empty.jsonl"
  path.write_text("[CpuDevice(id=0)]\n")
  with pytest.raises(SystemExit, match="no benchmark rows in .*empty.jsonl"):
    goals.main([str(path)])


def test_a_pass_the_peer_failed_and_ours_ran_counts_as_reached(tmp_path, capsys):
  """At 1M tokens the peer's forward+backward can run out of memory where ours runs: that
    pass reaches the goal, with our time and the peer's error; a pass where ours did not
    run either stays a note."""
  fast = 0.001
  oom = ("failed: JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
         "35.72GiB [executable_name='jit__lambda']")
  ran = _row("kda", "logsigmoid_strong", {"pallas": fast}, {"pallas": fast})
  del ran["vs_jla_fwdbwd"]
  ran |= {"pallas_fwd_ms": 1.0, "pallas_fwdbwd_ms": 130.7, "jla_fwd_ms": 2.0, "jla_fwdbwd": oom}
  neither = dict(ran, op="gla")
  del neither["pallas_fwdbwd_ms"]
  path = tmp_path / "bench.jsonl"
  path.write_text("\n".join(map(json.dumps, [ran, neither])))
  kda, gla = [goals.summarize(row, "jla", 1.0) for row in goals.read_rows([str(path)])]
  assert kda["met"] and kda["fwdbwd"] == {"setting": "pallas", "ours_ms": 130.7, "peer_failed": oom}
  assert gla["note"] == f"fwdbwd: {oom}"
  goals.main([str(path)])
  out = capsys.readouterr().out
  assert "| 130.7 / - | jla failed: Out of memory while trying to allocate 35.72GiB |" in out
  assert "1 of 2 lines reach 1x jla" in out

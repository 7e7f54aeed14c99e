"""experiments.probe_layer_memory on the tiny preset: real compiled figures, clear errors."""

import json

from experiments import probe_layer_memory as plm


def test_tiny_parts_compile_and_hold_more_than_their_save_points(tmp_path, capsys):
  out = tmp_path / "rows.json"
  assert plm.main(["linear", "moe", "--preset", "tiny", "--seq", "64", "--json", str(out)]) == 0
  assert len(capsys.readouterr().out.splitlines()) == 3  # header + one line per part
  rows = json.loads(out.read_text())
  assert [r["part"] for r in rows] == ["linear", "moe"]
  for r in rows:
    assert r["seq"] == 64 and r["planner_save_point_bytes"] > 0
    # the backward holds its save points and more (gradients, transients)
    assert r["xla_temp_bytes"] > r["planner_save_point_bytes"]
    assert abs(r["ratio"] - r["xla_temp_bytes"] / r["planner_save_point_bytes"]) < 1e-12


def test_unknown_part_and_field_exit_2(capsys):
  assert plm.main(["attention", "--preset", "tiny", "--seq", "64"]) == 2
  assert "unknown 'attention'" in capsys.readouterr().err
  assert plm.main(["moe", "--preset", "tiny", "--model.nope=1"]) == 2
  assert "nope" in capsys.readouterr().err

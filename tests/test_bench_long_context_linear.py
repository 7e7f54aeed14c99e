"""experiments/bench_long_context_linear.py at a tiny CPU shape: the widened [M | L] pass,
the scan's combine rounds and the output pass run and report the split's times against
the plain kernel's, so the benchmark keeps up with meshes.split_recurrence. On the
plain-JAX reference (the same contract as the kernels; the interpreted kernels compile
for a minute here, and tests/test_split_recurrence.py runs them split)."""
import json

from experiments import bench_long_context_linear as bench


def test_tiny_run_reports_the_split_against_the_plain_kernel(capsys):
  rows = bench.main(["--interpret", "--impl", "reference", "--op", "gla", "--tokens", "64"])
  printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()[1:]]
  assert printed == rows and [r["op"] for r in rows] == ["gla"]
  for row in rows:
    assert row["shape"] == [1, 64, 2, 16] and row["scan_rounds"] == 3 and row["impl"] == "reference"
    assert row["kernel_widths"] == [32, 16]  # [M | L] in one pass, then the outputs
    for kind in ("fwd", "fwdbwd"):
      assert row[f"plain_{kind}_ms"] > 0 and row[f"split_{kind}_ms"] > 0
      assert row[f"overhead_{kind}"] > 0

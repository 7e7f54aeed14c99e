"""experiments/bench_long_context_mla.py at a tiny CPU shape: both shares of the split MLA
run forward and backward and report their times, and the FLOPs it counts are those of the
causal keys a share really attends to."""
import json

from experiments import bench_long_context_mla as bench


def test_tiny_run_reports_both_shares(capsys):
  bench.main(["--interpret"])
  rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert rows[0]["devices"] == 8
  shares = {r["share"]: r for r in rows[1:]}
  assert set(shares) == {"last", "balanced"}
  assert shares["last"]["offsets"] == [224] and shares["balanced"]["offsets"] == [0, 240]
  assert all(r["fwdbwd_ms"] > 0 for r in shares.values())


def test_balanced_share_counts_the_average_causal_work():
  s = dict(bench.TINY, keys=1024, local=64)  # 16 devices
  last = bench._flops(s, [1024 - 64], 64)
  balanced = bench._flops(s, [0, 31 * 32], 32)
  mean = sum(bench._flops(s, [d * 64], 64) for d in range(16)) / 16
  # every device does the mean causal attention; each half up-projects its own causal
  # key blocks, so the late half repeats most of them (kv_rank / half the queries more)
  assert mean < balanced < 0.7 * last

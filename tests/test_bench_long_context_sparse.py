"""experiments/bench_long_context_sparse.py in its --interpret mode (tiny shapes on CPU,
the Pallas kernels interpreted): every share compiles, runs and is compared with the
last device's, so the benchmark keeps up with the kernels' signatures; the shares'
query offsets are the first, last and balanced devices'."""

from experiments import bench_long_context_sparse as bench


def test_shares_at_the_target_shapes():
  shapes = bench.Shapes()
  assert bench.share_offsets("first", shapes) == (0,)
  assert bench.share_offsets("last", shapes) == ((1 << 20) - 8192,)
  assert bench.share_offsets("balanced", shapes, 3) == (3 * 4096, 252 * 4096)
  last = bench.causal_keys(bench.share_offsets("last", shapes), shapes)
  for device in (0, 64, 127):
    balanced = bench.causal_keys(bench.share_offsets("balanced", shapes, device), shapes)
    assert abs(balanced / last - 0.5) < 0.01  # every device half the last one's work


def test_interpreted_run_reports_every_share(capsys):
  rows = bench.main([
      "--interpret", "--no-parts", "--keys", "64", "--local", "16", "--reps", "1", "--rounds", "1"
  ])
  assert list(rows) == list(bench.SHARES)
  for row in rows.values():
    assert isinstance(row["total"]["ms"], float), row
    assert isinstance(row["vs_last"], float), row
  assert rows["balanced"]["query_offsets"] == [0, 56]
  table = capsys.readouterr().out.splitlines()[-4:]
  assert table[0].split()[0] == "share" and [line.split()[0] for line in table[1:]] == list(
      bench.SHARES)

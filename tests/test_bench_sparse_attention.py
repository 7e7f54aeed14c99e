"""experiments/bench_sparse_attention.py at a tiny length on CPU (kernels interpreted):
every measurement the GPU runs compile and run once here, the backward kernel alone by
key ranges too, so the benchmark keeps up with the kernels' signatures."""
import json
import time

import jax

from experiments import bench_sparse_attention as bench


def _once(fn, *args, **timing):
  del timing
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return (time.perf_counter() - start) * 1e3


def test_each_measurement_runs_and_reports_a_time(monkeypatch, capsys):
  monkeypatch.setattr(bench, "median_ms", _once)
  monkeypatch.setattr(bench, "KEYS_PER_RANGE", 32)  # two key ranges at T = 64
  only = {
      "indexer_topk", "indexer_topk_q2_w4_bk32", "pallas_fwd", "pallas_fwdbwd_atomic",
      "dense_cudnn_causal_fwdbwd", "fwd_bk16_w2_s3", "bwd_dq_only_bk16_w2_s3",
      "bwd_atomic_bk16_w2_s3", "select_kernel_4bit_b64_w4", "select_threshold_2bit"
  }
  bench.bench(64, k_sel=16, only=only, fwd_tiles=((16, 2, 3),), bwd_tiles=((16, 2, 3),),
              select_tiles=((4, 64, 4),), indexer_tiles=((2, 4, 32),))
  report = json.loads(capsys.readouterr().out.splitlines()[-1])
  for name in only:
    assert isinstance(report.get(f"{name}_ms"), float), (name, report.get(f"{name}_ms"))

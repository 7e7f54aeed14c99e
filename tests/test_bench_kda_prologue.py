"""The KDA prologue benchmark: what it times as the XLA path is the layer's prologue, a
row without jla still carries the XLA path's and the fused kernel's figures, and the decay
gate's rows time both of its sides."""
import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_kda_prologue as bench


def test_ours_is_conv_silu_and_a_per_head_l2_norm_within_documents():
  x, w, segment_ids = bench.inputs(1, 64, 2, 8)
  y = np.asarray(bench.ours(x, w, segment_ids), np.float32)
  xf, seg = np.asarray(x, np.float32), np.asarray(segment_ids)
  for t in (0, 5, 40, 63):
    conv = sum(w[..., bench.TAPS - 1 - s] * xf[0, t - s]
               for s in range(bench.TAPS)
               if t - s >= 0 and seg[0, t - s] == seg[0, t])
    act = np.asarray(jax.nn.silu(jnp.asarray(conv)).astype(jnp.bfloat16), np.float32)
    want = act / np.sqrt(np.sum(act**2, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(y[0, t], want, rtol=2e-2, atol=2e-2)
  assert len(np.unique(seg)) > 1  # the inputs hold several documents


def test_a_row_without_jla_still_has_the_xla_path_and_the_fused_kernel():
  row = bench.bench_shape((1, 64, 2, 16), rounds=1, calls=1)
  for side in ("xla", "fused", "fused_blocks_bwd_one_kernel32", "fused_blocks"):
    assert row[f"{side}_fwd_ms"] > 0 and row[f"{side}_fwdbwd_ms"] > 0
  assert row["fused_vs_xla_fwd"] > 0 and row["rel_rms_fused_vs_xla"] < 1e-2
  for side in ("fused", "fused_blocks_bwd_two_kernels32", "fused_blocks_bwd_one_kernel32",
               "fused_blocks"):
    assert row[f"rel_rms_{side}_dx_vs_xla"] < 2e-2 and row[f"rel_rms_{side}_dw_vs_xla"] < 2e-2
  assert "jla" in row or "fused_vs_jla_fwd" in row


def test_the_gate_rows_time_the_fused_decay_against_the_xla_path():
  row = bench.bench_gate((1, 128, 2, 16), rounds=1, calls=1)
  for side in ("xla", "fused"):
    assert row[f"gate_{side}_fwd_ms"] > 0 and row[f"gate_{side}_fwdbwd_ms"] > 0
  assert row["gate_fused_vs_xla_fwdbwd"] > 0 and row["gate_rel_rms_fused_vs_xla"] < 1e-5

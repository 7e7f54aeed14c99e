"""Full causal attention of the MLA layers on one GPU: cuDNN's fused kernel against the
plain-JAX reference, forward and forward+backward, in one process.

    PYTHONPATH=src:. python3 experiments/bench_causal_attention.py [--json out.json] [--small]

Shapes: MLA heads as released (query/key head dim 192 = 128 nope + 64 shared, value head
dim 128), bf16, one row: Kimi Linear (32 heads) and Kimi K3 (96 heads) at 8192 and 32768
tokens, with the row packed as 4 documents (the training case: the segment mask goes in
as a [B, 1, T, T] boolean mask) and as one document. Times come from alternating rounds
(`experiments.timing.interleaved_ratios`); ratio > 1: cuDNN is faster. TFLOP/s count the
causal half of the pairs: forward 2 x (192 + 128) x pairs x heads, backward 2.5x that
(dq, dk, dv and the recomputed scores). --small runs a CPU-sized shape.
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from experiments.timing import failed, interleaved_ratios
from pallas_kernels.causal_attention.cudnn import cudnn_causal_attention
from pallas_kernels.causal_attention.reference import causal_attention_reference

DQK, DV = 192, 128
SHAPES = [(32, 8192), (32, 32768), (96, 8192), (96, 32768)]  # (heads, tokens)
SMALL = [(2, 256)]


def _inputs(heads, t, documents, dtype=jnp.bfloat16):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (1, t, heads, DQK), dtype)
  k = jax.random.normal(keys[1], (1, t, heads, DQK), dtype)
  v = jax.random.normal(keys[2], (1, t, heads, DV), dtype)
  do = jax.random.normal(keys[3], (1, t, heads, DV), dtype)
  seg = (jnp.arange(t) * documents // t).astype(jnp.int32)[None] if documents > 1 else None
  return q, k, v, do, seg


def _fns(attend, seg, block_q):
  fwd = jax.jit(lambda q, k, v: attend(q, k, v, segment_ids=seg, block_q=block_q))

  def loss(q, k, v, do):
    return jnp.sum(attend(q, k, v, segment_ids=seg, block_q=block_q).astype(jnp.float32) * do)

  bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return fwd, bwd


def measure(heads, t, documents, rounds, calls):
  q, k, v, do, seg = _inputs(heads, t, documents)
  block_q = 512 if t >= 8192 else 64
  ref_fwd, ref_bwd = _fns(causal_attention_reference, seg, block_q)
  fused_fwd, fused_bwd = _fns(cudnn_causal_attention, seg, block_q)
  out = {"heads": heads, "tokens": t, "documents": documents}
  pairs = t * (t + 1) / 2 / (documents if documents > 1 else 1)  # causal, within documents
  flops = 2.0 * (DQK + DV) * pairs * heads
  err = np.abs(
      np.asarray(fused_fwd(q, k, v), np.float32) - np.asarray(ref_fwd(q, k, v), np.float32)).max()
  out["max_abs_diff_fwd"] = float(err)
  for name, ref, fused, args, work in (("forward", ref_fwd, fused_fwd, (q, k, v), flops),
                                       ("forward+backward", ref_bwd, fused_bwd, (q, k, v, do),
                                        3.5 * flops)):
    try:
      r = interleaved_ratios({"cudnn": fused}, ref, *args, rounds=rounds, calls=calls)
      out[name] = {
          "reference_ms": r["baseline_ms"],
          "cudnn_ms": r["cudnn"]["ms"],
          "speedup": r["cudnn"]["median"],
          "cudnn_tflops": round(work / r["cudnn"]["ms"] / 1e9, 1),
      }
    except Exception as e:  # noqa: BLE001 - reported, the benchmark goes on
      out[name] = failed(e)
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--json", default=None)
  p.add_argument("--small", action="store_true")
  args = p.parse_args(argv)
  shapes, rounds, calls = (SMALL, 2, 1) if args.small else (SHAPES, 7, 3)
  results = {"device": str(jax.devices()[0].device_kind), "runs": []}
  for heads, t in shapes:
    for documents in (4, 1):
      row = measure(heads, t, documents, rounds, calls)
      print(json.dumps(row), flush=True)
      results["runs"].append(row)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()

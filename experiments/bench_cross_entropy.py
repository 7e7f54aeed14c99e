"""Chunked cross-entropy on one GPU: time and temporary memory next to the naive loss.

    PYTHONPATH=src:. python3 experiments/bench_cross_entropy.py [--json out.json] [--peers jla,liger]

Shape: N=8192 tokens, d=7168, V=163840, bf16. The naive loss forms the [N, V] logits
with a bf16 matmul, upcasts them to fp32 and differentiates through XLA (the common
baseline; its temporaries are the bf16 and fp32 logits). Gradient wrt hidden (frozen
lm_head, the LoRA case) and wrt both, for a few token-chunk sizes.

Every version's time comes from alternating rounds with the naive loss in this process
(`experiments.timing.interleaved_ratios`), so time_vs_naive is a same-run ratio. The
peers, where installed, run in the same rounds: jla's `linear_cross_entropy(impl="xla")`
and Liger's fused linear cross-entropy (PyTorch, on the same arrays); an absent peer is
reported as missing. --small runs a CPU-sized shape.
"""

import argparse
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from experiments.timing import block, failed, interleaved_ratios, peer, to_torch
from pallas_kernels.cross_entropy import chunked_cross_entropy

N, D, V = 8192, 7168, 163840
SMALL = (256, 128, 4096)
PEERS = ("jla", "liger")


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def naive_loss(hidden, lm_head, labels):
  logits = (hidden @ lm_head).astype(jnp.float32)
  valid = labels != -100
  safe = jnp.where(valid, labels, 0)
  per_token = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, safe[:, None], -1)[:, 0]
  return jnp.sum(jnp.where(valid, per_token, 0.0))


def compile_grad(fn, argnums, args):
  """grad(fn) compiled once: (compiled, temp GB)."""
  compiled = jax.jit(jax.grad(fn, argnums=argnums)).lower(*args).compile()
  mem = compiled.memory_analysis()
  return compiled, None if mem is None else round(mem.temp_size_in_bytes / 1e9, 3)


def peer_grads(name, argnums, hidden, lm_head, labels):
  """A peer's gradient as a function of no arguments and its temp GB (None where XLA
    does not compile it), or (None, "missing: ...") where the peer is not installed."""

  def jla():
    from jla.ops.cross_entropy import linear_cross_entropy
    weight = jnp.asarray(lm_head.T)  # jla takes [V, d]: laid out once, outside the timing
    loss = lambda h, w, y: linear_cross_entropy(h, w, y, impl="xla")[0]
    compiled, temp = compile_grad(loss, argnums, (hidden, weight, labels))
    return (lambda: compiled(hidden, weight, labels)), temp

  def liger():  # PyTorch on the same arrays; it forms the gradient in its forward
    import torch
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")
    h = to_torch(hidden, requires_grad=True)
    w = to_torch(jnp.asarray(lm_head.T), requires_grad=argnums != 0)
    y = to_torch(labels).long()
    wrt = [h] if argnums == 0 else [h, w]
    return (lambda: torch.autograd.grad(loss(w, h, y), wrt)), None

  made, missing = peer({"jla": jla, "liger": liger}[name])
  return made if made else (None, missing)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", default=None)
  parser.add_argument(
      "--chunks", default=None, help="token_chunk:logits_chunk pairs (default 1024:256,1024:512,"
      "2048:256; small 64:32,128:64)")
  parser.add_argument("--peers", default=",".join(PEERS),
                      help=f"peers to time in the same rounds, of {PEERS}, or none")
  parser.add_argument("--rounds", type=int, default=5,
                      help="alternating rounds, one call of each version a round (odd)")
  parser.add_argument("--small", action="store_true", help=f"CPU-sized shape {SMALL}")
  args = parser.parse_args()
  peers = [p for p in args.peers.split(",") if p and p != "none"]
  unknown = [p for p in peers if p not in PEERS]
  if unknown:
    parser.error(f"--peers: unknown {unknown}; choose from {PEERS} or none")
  if "liger" in peers and importlib.util.find_spec("liger_kernel"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch shares the GPU
  if args.rounds < 1 or args.rounds % 2 == 0:
    parser.error("--rounds: an odd count (time_vs_naive inverts the median ratio)")
  n, d, v = SMALL if args.small else (N, D, V)
  chunks = args.chunks or ("64:32,128:64" if args.small else "1024:256,1024:512,2048:256")
  keys = jax.random.split(jax.random.key(0), 4)
  hidden = jax.random.normal(keys[0], (n, d), jnp.bfloat16)
  lm_head = (jax.random.normal(keys[1], (d, v), jnp.float32) * 0.02).astype(jnp.bfloat16)
  labels = jax.random.randint(keys[2], (n,), 0, v)
  labels = jnp.where(jax.random.uniform(keys[3], (n,)) < 0.05, -100, labels)
  inputs = (hidden, lm_head, labels)
  report = {"device": str(jax.devices()[0]), "shape": [n, d, v], "jax": jax.__version__}
  for wrt, argnums in (("hidden", 0), ("both", (0, 1))):
    naive, temp = compile_grad(naive_loss, argnums, inputs)
    naive_grads = naive(*inputs)
    naive_grads = naive_grads if wrt == "both" else (naive_grads,)
    entries, versions = {}, {}
    for chunk in chunks.split(","):
      tc, lc = map(int, chunk.split(":"))
      fn = lambda h, w, y, tc=tc, lc=lc: chunked_cross_entropy(h, w, y, token_chunk=tc, logits_chunk
                                                               =lc)[0]
      compiled, temp_c = compile_grad(fn, argnums, inputs)
      grads = compiled(*inputs)
      grads = grads if wrt == "both" else (grads,)
      name = f"chunked{tc}_{lc}_grad_{wrt}"
      entries[name] = {
          "temp_GB": temp_c,
          "temp_vs_naive": round(temp_c / temp, 4),
          "grad_rel_err_vs_naive": [round(rel_err(g, w), 5) for g, w in zip(grads, naive_grads)]
      }
      versions[name] = lambda compiled=compiled: compiled(*inputs)
      del grads
    for name in peers:
      key = f"{name}_grad_{wrt}"
      try:
        fn, temp_p = peer_grads(name, argnums, *inputs)
        if fn is not None:
          block(fn())  # a peer that fails is reported, not timed
      except Exception as e:
        entries[key] = failed(e)
        continue
      if fn is None:
        entries[key] = temp_p  # "missing: ..."
        continue
      entries[key] = {"temp_GB": temp_p}
      versions[key] = fn
    rounds = interleaved_ratios(versions, lambda: naive(*inputs), rounds=args.rounds, calls=1)
    ms = rounds["baseline_ms"]
    report[f"naive_grad_{wrt}"] = {"temp_GB": temp, "ms": round(ms, 2)}
    print(json.dumps({wrt: report[f"naive_grad_{wrt}"]}), flush=True)
    for name, entry in entries.items():
      if name in versions:  # ms and time / naive from the same rounds (odd count:
        r = rounds[name]  # 1 / the median ratio is the median of the inverses)
        entry.update(ms=round(r["ms"], 2), time_vs_naive=round(1 / r["median"], 3),
                     vs_naive_interleaved=r)
      report[name] = entry
      print(json.dumps({name: entry}), flush=True)
  loss_naive = jax.jit(naive_loss)(*inputs)
  loss_chunked = jax.jit(lambda *a: chunked_cross_entropy(*a)[0])(*inputs)
  report["loss_rel_err_vs_naive"] = abs(float(loss_chunked) / float(loss_naive) - 1)
  print(json.dumps(report, indent=1))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()

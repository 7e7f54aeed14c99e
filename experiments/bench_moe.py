"""MoE benchmark: grouped matmul next to XLA's ragged_dot and a dense matmul of the same
FLOPs, then one target MoE layer slice forward and forward+backward.

    PYTHONPATH=src:. python3 experiments/bench_moe.py [--small] [--json out.json]

1. Grouped matmul (the registered "grouped_matmul" op: the Mosaic kernel on GPU, ragged_dot
   elsewhere) at M=65536 K=7168 N=4096, 14 groups, balanced and skewed group sizes:
   forward and input gradient TFLOP/s, XLA `jax.lax.ragged_dot`, dense matmul. Kernel-only
   timings and the tile sweep are in experiments/bench_grouped_matmul.py.
2. One expert-parallel rank's share of a target MoE layer: 16K tokens routed top-16 over
   896 experts, every pair served by the rank's 14 local experts (the balanced steady
   state: a rank receives as many pairs as it sends), LoRA rank 16 on gate_up. Router,
   sort/permute, grouped SwiGLU + LoRA, unpermute and combine; forward and
   forward+backward (input and LoRA gradients), next to dense matmuls of the same FLOPs.
3. With more than one device: the "ep_alltoall" dispatcher over all of them (fsdp=1,
   expert=devices), forward and forward+backward, dropped fraction.

Every ratio (against dense, XLA's ragged_dot) comes from alternating rounds of one run
(`experiments.timing.interleaved_ratios`), figures on their own from
`experiments.timing.median_ms`. Expert TFLOP/s of forward + backward count what a LoRA
step computes with frozen experts (`expert_fwd_bwd_flops`).

--small shrinks every shape so the whole script runs on CPU in about a minute.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_grouped_matmul import rel_err
from experiments.timing import interleaved_ratios, median_ms
from hylora import ops
from hylora.core.config import KernelConfig, MeshConfig, MoEConfig
from hylora.model.ffn.dispatch import dropless
from hylora.model.ffn.expert_parallel import ep_alltoall
from meshes.mesh import build_mesh
from meshes.rules import activation_mesh

FULL = dict(m=65536, k=7168, n=4096, groups=14, tokens=16384, d=7168, ffn=2048, experts=896,
            top_k=16, local=14, rank=16, reps=10, calls=5)
SMALL = dict(m=512, k=256, n=128, groups=14, tokens=256, d=128, ffn=64, experts=56, top_k=4,
             local=14, rank=4, reps=2, calls=1)
# reps: timed calls of a figure, and rounds of a comparison; calls: calls per round


def group_sizes(m, g, kind):
  if kind == "balanced":
    sizes = np.full(g, m // g)
  else:  # skewed: Zipf-like 1/(i+1), the first group gets ~30% of the rows
    w = 1.0 / np.arange(1, g + 1)
    sizes = np.floor(w / w.sum() * m).astype(np.int64)
  sizes[-1] += m - sizes.sum()
  return jnp.asarray(sizes, jnp.int32)


def tflops(flop, ms):
  return float(f"{flop / 1e12 / (ms / 1e3):.4g}")


def bench_grouped_matmul(s, report):
  m, k, n, g, reps = s["m"], s["k"], s["n"], s["groups"], s["reps"]
  keys = jax.random.split(jax.random.key(0), 3)
  lhs = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  rhs = (jax.random.normal(keys[1], (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  dout = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
  flop = 2 * m * k * n
  gmm = ops.resolve("grouped_matmul", KernelConfig())
  fwd = jax.jit(gmm)
  # Input gradient alone (frozen rhs): the vjp in lhs, lhs passed in, not baked in.
  dlhs_of = jax.jit(lambda l, d, w, gs: jax.vjp(lambda l: gmm(l, w, gs), l)[1](d)[0])
  dlhs = lambda d, w, gs: dlhs_of(lhs, d, w, gs)
  xla = jax.jit(jax.lax.ragged_dot)
  xla_dlhs = jax.jit(lambda d, w, gs: jax.lax.ragged_dot(d, jnp.swapaxes(w, 1, 2), gs))
  dense_fwd, dense_dlhs = jax.jit(jnp.matmul), jax.jit(lambda d, w: d @ w.T)
  dense = {
      "fwd_tflops": tflops(flop, median_ms(dense_fwd, lhs, rhs[0], reps=reps)),
      "dlhs_tflops": tflops(flop, median_ms(dense_dlhs, dout, rhs[0], reps=reps))
  }
  out = report["grouped_matmul"] = {
      "shape": [m, k, n, g],
      "impl": getattr(gmm, "__module__", ""),
      "dense_same_flops": dense
  }
  rounds = dict(rounds=reps, calls=s["calls"])
  for kind in ("balanced", "skewed"):
    gs = group_sizes(m, g, kind)
    r = out[kind] = {"group_sizes": gs.tolist()}
    r["fwd_rel_err_vs_ragged_dot"] = rel_err(fwd(lhs, rhs, gs), xla(lhs, rhs, gs))
    r["fwd_tflops"] = tflops(flop, median_ms(fwd, lhs, rhs, gs, reps=reps))
    r["dlhs_tflops"] = tflops(flop, median_ms(dlhs, dout, rhs, gs, reps=reps))
    # Ratios from alternating rounds: ours and the other side in the same run.
    vs_dense_fwd = interleaved_ratios({"grouped": lambda: fwd(lhs, rhs, gs)},
                                      lambda: dense_fwd(lhs, rhs[0]), **rounds)
    vs_dense_dlhs = interleaved_ratios({"grouped": lambda: dlhs(dout, rhs, gs)},
                                       lambda: dense_dlhs(dout, rhs[0]), **rounds)
    vs_xla_fwd = interleaved_ratios({"grouped": fwd}, xla, lhs, rhs, gs, rounds=reps, calls=1)
    vs_xla_dlhs = interleaved_ratios({"grouped": dlhs}, xla_dlhs, dout, rhs, gs, rounds=reps,
                                     calls=1)
    r["xla_ragged_dot_fwd_tflops"] = tflops(flop, vs_xla_fwd["baseline_ms"])
    r["xla_ragged_dot_dlhs_tflops"] = tflops(flop, vs_xla_dlhs["baseline_ms"])
    r["fwd_vs_dense"] = vs_dense_fwd["grouped"]["median"]
    r["dlhs_vs_dense"] = vs_dense_dlhs["grouped"]["median"]
    r["fwd_vs_xla_ragged_dot"] = round(vs_xla_fwd["grouped"]["median"], 1)
    r["dlhs_vs_xla_ragged_dot"] = round(vs_xla_dlhs["grouped"]["median"], 1)
    r["interleaved"] = {
        "fwd_vs_dense": vs_dense_fwd,
        "dlhs_vs_dense": vs_dense_dlhs,
        "fwd_vs_xla_ragged_dot": vs_xla_fwd,
        "dlhs_vs_xla_ragged_dot": vs_xla_dlhs
    }
    print(json.dumps({kind: r}), flush=True)


def expert_arrays(s, experts, seed=1):
  d, f, r = s["d"], s["ffn"], s["rank"]
  keys = jax.random.split(jax.random.key(seed), 5)
  normal = lambda key, shape, std, dtype=jnp.bfloat16: (jax.random.normal(key, shape, jnp.float32) *
                                                        std).astype(dtype)
  weights = {
      "gate_up": normal(keys[0], (experts, d, 2 * f), d**-0.5),
      "down": normal(keys[1], (experts, f, d), f**-0.5)
  }
  lora = {
      "lora_a": normal(keys[2], (experts, d, r), d**-0.5, jnp.float32),
      "lora_b": normal(keys[3], (experts, r, 2 * f), 0.02, jnp.float32)
  }
  router = normal(keys[4], (d, s["experts"]), d**-0.5)
  return weights, lora, router


def route(x, router, top_k):
  scores = jax.nn.sigmoid(jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32)))
  weights, experts = jax.lax.top_k(scores, top_k)
  return weights / jnp.sum(weights, axis=-1, keepdims=True), experts.astype(jnp.int32)


def expert_fwd_flops(s, pairs):
  """FLOPs of the experts' forward over `pairs` routed (token, expert) rows: gate_up
  [d, 2f] and down [f, d] (frozen), and the rank-r LoRA factors on gate_up, x @ A and
  (x A) @ B."""
  d, f, r = s["d"], s["ffn"], s["rank"]
  return 2 * pairs * (d * 2 * f + f * d + r * (d + 2 * f))


def expert_fwd_bwd_flops(s, pairs):
  """FLOPs of the experts' forward + backward in a LoRA step, as the step computes them.

  The expert weights are frozen, so the backward of each frozen matmul y = x W computes
  the input gradient dX = dY W^T only (the same FLOPs as the forward), never the weight
  gradient x^T dY: forward + backward is 2x the forward, not the 3x of a full training
  step. The LoRA factors on gate_up are trained, so they count as they run: forward
  x @ A and (x A) @ B, backward dB = (x A)^T dY, d(x A) = dY B^T, dA = x^T d(x A) and
  the input term d(x A) A^T: 3x their forward."""
  d, f, r = s["d"], s["ffn"], s["rank"]
  frozen = 2 * pairs * (d * 2 * f + f * d)  # gate_up and down, forward
  lora = 2 * pairs * r * (d + 2 * f)  # x @ A and (x A) @ B, forward
  return 2 * frozen + 3 * lora


def time_layer(report_key, s, report, fn, x, lora, pairs):
  probe = jax.random.normal(jax.random.key(7), x.shape, x.dtype)
  fwd = jax.jit(fn)
  grads = jax.jit(
      jax.grad(lambda x, l: jnp.sum((fn(x, l)[0] * probe).astype(jnp.float32)), argnums=(0, 1)))
  r = report[report_key] = {"tokens": x.shape[0], "pairs": pairs}
  y, stats = fwd(x, lora)
  r["dropped_fraction"] = float(stats["dropped_tokens"]) / pairs
  r["fwd_ms"] = round(median_ms(fwd, x, lora, reps=s["reps"]), 3)
  r["fwd_bwd_ms"] = round(median_ms(grads, x, lora, reps=s["reps"]), 3)
  r["expert_fwd_tflops"] = tflops(expert_fwd_flops(s, pairs), r["fwd_ms"])
  # Frozen experts: input gradients only, plus the LoRA factors' gradients (2x forward
  # for the frozen matmuls, 3x for the LoRA factors; expert_fwd_bwd_flops).
  r["expert_fwd_bwd_tflops"] = tflops(expert_fwd_bwd_flops(s, pairs), r["fwd_bwd_ms"])
  print(json.dumps({report_key: r}), flush=True)
  return r, fwd


def bench_layer_slice(s, report):
  """One rank's share: every routed pair goes to one of the 14 local experts."""
  weights, lora, router = expert_arrays(s, s["local"])
  x = jax.random.normal(jax.random.key(3), (s["tokens"], s["d"]), jnp.bfloat16)
  options = {"kernels": KernelConfig(), "lora_scale": 2.0}

  def layer(x, lora):
    w, experts = route(x, router, s["top_k"])
    slots = experts % s["local"]  # the steady state: all pairs land on local experts
    return dropless(x, w, slots, {**weights, **lora}, options, num_experts=s["local"])

  pairs = s["tokens"] * s["top_k"]
  r, fwd = time_layer("layer_slice", s, report, layer, x, lora, pairs)
  m, d, f = pairs, s["d"], s["ffn"]
  a = jax.random.normal(jax.random.key(4), (m, d), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(5), (d, 3 * f), jnp.bfloat16)
  dense = jax.jit(jnp.matmul)
  # The layer's forward and the dense matmul of its frozen FLOPs in alternating rounds.
  vs = r["fwd_vs_dense_interleaved"] = interleaved_ratios({"layer": lambda: fwd(x, lora)},
                                                          lambda: dense(a, w), rounds=s["reps"],
                                                          calls=1)
  r["dense_same_flops_ms"] = round(vs["baseline_ms"], 3)
  r["fwd_vs_dense"] = vs["layer"]["median"]


def bench_expert_parallel(s, report):
  devices = jax.device_count()
  if devices == 1:
    report["expert_parallel"] = "skipped: one device"
    return
  mesh = build_mesh(MeshConfig(fsdp=1, expert=devices))
  experts = s["local"] * devices
  weights, lora, router = expert_arrays(s, experts)
  router = router[:, :experts] if router.shape[1] >= experts else jnp.tile(
      router, (1, -(-experts // router.shape[1])))[:, :experts]
  tokens = s["tokens"] * devices
  x = jax.random.normal(jax.random.key(3), (tokens, s["d"]), jnp.bfloat16)
  options = {"kernels": KernelConfig(), "lora_scale": 2.0}
  moe = MoEConfig(experts=experts, top_k=s["top_k"], capacity_factor=2.0, overlap_chunks=2)

  def layer(x, lora):
    w, slots = route(x, router, s["top_k"])
    with activation_mesh(mesh):
      return ep_alltoall(x, w, slots, {**weights, **lora}, options, num_experts=experts, moe=moe)

  time_layer("expert_parallel", s, report, layer, x, lora, tokens * s["top_k"])
  report["expert_parallel"]["mesh"] = dict(mesh.shape)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--small", action="store_true", help="CPU-sized shapes")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  s = SMALL if args.small else FULL
  report = {
      "device": str(jax.devices()[0]),
      "devices": jax.device_count(),
      "jax": jax.__version__,
      "small": args.small
  }
  bench_grouped_matmul(s, report)
  bench_layer_slice(s, report)
  bench_expert_parallel(s, report)
  print(json.dumps(report, indent=1))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()

"""Whole-step profile on one GPU: tokens/s, step time split by layer kind, and model-FLOPs
utilisation against the H200's dense bf16 peak.

  python -m experiments.bench_step                 # gpu-1 preset (one H200)
  python -m experiments.bench_step --planned       # under the memory planner's remat plan
  python -m experiments.bench_step --small         # tiny shapes on one CPU device (CI)

The whole step is the compiled train step (`hylora.train.trainer.Trainer`). Its split
comes from separate jitted sub-benchmarks at the step's shapes, each forward + backward
(input gradient, and LoRA gradients where there are adapters): one linear-attention
mixer, one sparse-attention mixer, one MoE FFN, one dense FFN, the LM-head loss and the
optimizer update; each is multiplied by how often the model runs it. "other" is the
whole step minus their sum (embedding, norms, residuals, layer glue).

Model FLOPs count what the LoRA step has to compute, from the config: every frozen
matmul forward + input gradient (4 m n k per token-row), every LoRA factor forward +
input gradient + weight gradient (6 m n k), attention cores forward + backward (3x the
forward), the indexer forward only (its selection is not differentiated). Remat
recomputation is not counted (it is overhead, not model work).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from experiments.timing import median_ms

H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s


def flops_per_step(cfg) -> dict[str, float]:
  """Model FLOPs of one optimizer step, split like the timing table: the architecture's
  description (hylora.core.architecture.step_flops) grouped by layer kind."""
  from hylora.core.architecture import step_flops

  flops = step_flops(cfg)
  return {
      "linear attention": flops.get("linear", 0.0),
      "sparse attention": flops.get("sparse", 0.0),
      "MoE FFN": flops.get("moe", 0.0),
      "dense FFN": flops.get("dense", 0.0),
      "loss (LM head)": flops["lm_head"],
      "optimizer": 0.0
  }


def layer_counts(cfg) -> dict[str, int]:
  kinds = cfg.model.layer_kinds()
  return {
      "linear": sum(k == "linear" for k, _ in kinds),
      "sparse": sum(k == "sparse" for k, _ in kinds),
      "moe": sum(f == "moe" for _, f in kinds),
      "dense": sum(f == "dense" for _, f in kinds)
  }


def _module_ms(module, x, ctx, repeats: int) -> float:
  from flax import nnx

  from hylora.model import LoRAParam

  graphdef, lora, rest = nnx.split(module, LoRAParam, ...)
  from hylora.plan.part_memory import part_gradients
  return median_ms(part_gradients(graphdef), lora, x, rest, ctx, reps=repeats)


def part_inputs(cfg):
  """(x [B, T, d] bf16, ForwardContext) at the step's shapes: what one part sees."""
  import jax
  import jax.numpy as jnp

  from hylora.model.context import ForwardContext
  from hylora.model.execution import Execution
  b, s, d = cfg.train.batch_size, cfg.train.seq_len, cfg.model.d_model
  x = jax.random.normal(jax.random.key(0), (b, s, d), jnp.float32).astype(jnp.bfloat16)
  segments = jnp.zeros((b, s), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  return x, ForwardContext(segments, positions, execution=Execution(cfg.kernels, cfg.memory))


def sub_benchmarks(cfg, repeats: int) -> dict[str, float]:
  """Milliseconds per step of each part (one module's time x how often a step runs it)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from hylora import ops
  from hylora.model.ffn import FFNS
  from hylora.model.init import ParamInit
  from hylora.model.mixers import MIXERS
  from hylora.train.optimizer import make_optimizer

  m, t = cfg.model, cfg.train
  b, s, d = t.batch_size, t.seq_len, m.d_model
  x, ctx = part_inputs(cfg)
  counts = layer_counts(cfg)
  init = ParamInit(0)
  out = {}
  for part, kind, table in (("linear attention", "linear", MIXERS), ("sparse attention", "sparse",
                                                                     MIXERS),
                            ("MoE FFN", "moe", FFNS), ("dense FFN", "dense", FFNS)):
    if counts[kind]:
      out[part] = counts[kind] * _module_ms(table[kind](cfg.model, cfg.lora, init=init), x, ctx,
                                            repeats)

  ce = ops.resolve("cross_entropy", cfg.kernels)
  head = jax.random.normal(jax.random.key(1), (d, m.vocab_size), jnp.float32)
  head = (head * d**-0.5).astype(jnp.bfloat16)
  labels = jax.random.randint(jax.random.key(2), (b * s,), 0, m.vocab_size)
  loss_grad = jax.jit(jax.grad(lambda h, head, labels: ce(h, head, labels)[0] / (b * s)))
  out["loss (LM head)"] = median_ms(loss_grad, x.reshape(b * s, d), head, labels, reps=repeats)

  from hylora.train.state import model_parts
  parts = model_parts(cfg, t.seed)
  lora = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), nnx.to_pure_dict(parts.lora_template))
  optimizer = make_optimizer(t)
  state = optimizer.init(lora)

  @jax.jit
  def update(lora, state, grads):
    updates, state = optimizer.update(grads, state, lora)
    return jax.tree.map(lambda p, u: p + u, lora, updates), state

  grads = jax.tree.map(lambda a: jnp.full(a.shape, 1e-3, a.dtype), lora)
  out["optimizer"] = median_ms(update, lora, state, grads, reps=repeats)
  return out


def step_setup(cfg, devices):
  """(trainer, lora, opt_state, frozen, packer): a train step's state on `devices`."""
  from hylora.data.sources import Packer, make_source
  from hylora.train.trainer import Trainer
  from meshes.mesh import build_mesh

  tc = cfg.train
  trainer = Trainer(cfg, build_mesh(cfg.mesh, devices))
  lora, opt_state, frozen = trainer.init()
  packer = Packer(make_source(tc.data, cfg.model.vocab_size, tc.seed, tc.synthetic_docs),
                  tc.seq_len)
  return trainer, lora, opt_state, frozen, packer


def whole_step(cfg, steps: int, devices) -> dict:
  """Seconds per compiled train step: the median of `steps` timed steps after the untimed
  ones of experiments.timing.median_ms, each step on its own batch (put on the devices
  beforehand) and the state the step before left."""
  import jax

  tc = cfg.train
  trainer, lora, opt_state, frozen, packer = step_setup(cfg, devices)
  batches = [trainer.put_batch(packer.next_batch(tc.batch_size)) for _ in range(steps + 2)]
  trainer.compile(lora, opt_state, frozen, batches[0])
  state = {"lora": lora, "opt_state": opt_state, "step": 0}

  def one_step():
    i = state["step"]
    state["lora"], state["opt_state"], state["metrics"] = trainer.step(
        state["lora"], state["opt_state"], frozen, batches[i], i)
    state["step"] = i + 1
    return state["metrics"]

  seconds = median_ms(one_step, warmup=1, reps=steps) / 1e3
  return {
      "step_seconds": seconds,
      "tokens_per_s": tc.batch_size * tc.seq_len / seconds,
      "compile_seconds": trainer.compile_seconds,
      "final_loss": float(jax.device_get(state["metrics"]["loss"]))
  }


def small_config():
  """The tiny preset on one device, one `L L L S` period: a CPU smoke run."""
  from hylora.core.config import MeshConfig
  from hylora.core.presets import tiny
  cfg = tiny()
  return dataclasses.replace(cfg, preset="tiny-1", mesh=MeshConfig(fsdp=1, expert=1, devices=0),
                             model=dataclasses.replace(cfg.model, layers=4, dense_layers=1),
                             train=dataclasses.replace(cfg.train, batch_size=2, seq_len=64))


def planned_policy(cfg, device):
  """The planner's tiered policy for one device of this kind (its memory limit)."""
  from hylora.plan.part_memory import measured_working_bytes
  from hylora.plan.remat_planner import plan_memory
  from hylora.plan.save_point_sizes import tokens_per_device
  budget = (device.memory_stats() or {}).get("bytes_limit", 141e9)
  working = measured_working_bytes(cfg, tokens_per_device(cfg, (1, 1)))
  plan = plan_memory(cfg, (1, 1), budget, working_bytes=working)
  print(plan.table(), flush=True)
  if not plan.fits:
    print("the plan does not fit: running it anyway", flush=True)
  return plan.policy_config()


def profile(cfg, steps: int, repeats: int, peak: float, devices=None) -> dict:
  step = whole_step(cfg, steps, devices)
  print(f"whole step: {json.dumps(step)}", flush=True)
  parts = sub_benchmarks(cfg, repeats)
  flops = flops_per_step(cfg)
  step_ms = step["step_seconds"] * 1e3
  total_flops = sum(flops.values())
  return {
      "preset": cfg.preset,
      "memory": dataclasses.asdict(cfg.memory),
      **step, "step_ms": step_ms,
      "parts_ms": parts,
      "other_ms": step_ms - sum(parts.values()),
      "flops": flops,
      "model_flops_per_step": total_flops,
      "peak_flops": peak,
      "mfu": total_flops / step["step_seconds"] / peak
  }


def format_report(r: dict) -> str:
  lines = [
      f"{r['preset']}: {r['step_ms']:.1f} ms/step, {r['tokens_per_s']:.0f} tokens/s, "
      f"MFU {100 * r['mfu']:.1f}% of {r['peak_flops'] / 1e12:.0f} TFLOP/s "
      f"(compile {r['compile_seconds']:.0f} s)",
      f"{'part':<18} {'ms/step':>9} {'share':>7} {'model GFLOP':>12} {'TFLOP/s':>9}"
  ]
  for part, ms in r["parts_ms"].items():
    f = r["flops"].get(part, 0.0)
    rate = f / (ms * 1e-3) / 1e12 if ms > 0 else 0.0
    lines.append(f"{part:<18} {ms:>9.2f} {100 * ms / r['step_ms']:>6.1f}% {f / 1e9:>12.2f} "
                 f"{rate:>9.3f}")
  lines.append(f"{'other':<18} {r['other_ms']:>9.2f} {100 * r['other_ms'] / r['step_ms']:>6.1f}%")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  from hylora.core.errors import ConfigError
  from hylora.core.overrides import apply_overrides, split_overrides
  from hylora.core.presets import get_preset

  p = argparse.ArgumentParser(prog="python -m experiments.bench_step",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--small", action="store_true", help="tiny shapes on one CPU device")
  p.add_argument("--steps", type=int, default=5, help="timed steps after the first")
  p.add_argument("--repeats", type=int, default=5, help="timed runs per sub-benchmark")
  p.add_argument("--peak", type=float, default=H200_BF16_PEAK, help="peak FLOP/s for MFU")
  p.add_argument("--out", default=None, help="folder for bench_step.json")
  p.add_argument(
      "--planned", action="store_true",
      help="run the step under the memory planner's remat plan for this device "
      "(its working set compiled per layer part) instead of cfg.memory")
  p.add_argument("--parts-only", action="store_true",
                 help="only the per-part sub-benchmarks (no whole step, no MFU)")
  p.add_argument("--step-only", action="store_true",
                 help="only the whole step (no per-part sub-benchmarks, no split)")
  try:
    overrides, rest = split_overrides(argv)
    args = p.parse_args(rest)
    base = small_config() if args.small else get_preset("gpu-1")
    cfg = apply_overrides(base, overrides).validate()
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  import jax
  devices = jax.devices()[:1]
  if args.planned:
    cfg = dataclasses.replace(cfg, memory=planned_policy(cfg, devices[0]))
  if args.step_only:
    report = {"preset": cfg.preset, **whole_step(cfg, args.steps, devices)}
    print(json.dumps(report, indent=2))
  elif args.parts_only:
    report = {
        "preset": cfg.preset,
        "parts_ms": sub_benchmarks(cfg, args.repeats),
        "flops": flops_per_step(cfg)
    }
    print(json.dumps(report, indent=2))
  else:
    report = profile(cfg, args.steps, args.repeats, args.peak, devices)
    print(format_report(report))
  if args.out:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_step.json").write_text(json.dumps(report, indent=2) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())

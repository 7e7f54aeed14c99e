"""Remat policies side by side: step time and peak memory of full, minimal, tiered and the
planner's choice (and none, to show it does not fit), in one run, next to the planner's
predictions.

  python -m experiments.bench_memory                      # one GPU, gpu-1 preset
  python -m experiments.bench_memory --seq 32768 --budget 141GB --json out.json
  python -m experiments.bench_memory --small              # CPU, 8 simulated devices
  python -m experiments.bench_memory --model.layers=4     # any config field, as in the main command

Peak is XLA's figure for the compiled step (arguments + outputs - aliased + temporaries);
on a GPU the allocator's peak (`peak_bytes_in_use`, cumulative over the run) is recorded
too. Step times are medians of --steps timed steps (experiments.timing.median_ms); the
"vs full" speed-ups come from alternating rounds of every policy that ran and `full`
after all of them (experiments.timing.interleaved_ratios), not from the separate
figures. The budget defaults to the device's `bytes_limit` (run with
XLA_PYTHON_CLIENT_MEM_FRACTION=.95 to give XLA most of the GPU). Without --seq the sequence is the shortest of 8K..128K at which the planner predicts
that `none` does not fit the budget. The plan's working set of one layer is taken from
the layer parts compiled on this backend (`hylora.plan.part_memory`), not from the planner's
analytic estimate, unless --analytic-working-set. When XLA compiles the planner's choice
to a peak over the budget, it is planned again with that error taken off the budget
(`hylora.plan.remat_planner.replan_after_compile`, up to --replans times) and the replans are
reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from experiments.timing import failed, interleaved_ratios, median_ms

GB = 1e9
HAND_TIERED = {
    "hbm_names": ("qkv", "attention", "topk_indices", "lora_a"),
    "host_names": ("expert_gate_up", "mlp_gate_up", "gates")
}


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--small", action="store_true", help="tiny model on 8 simulated CPU devices")
  p.add_argument("--seq", type=int, default=None, help="sequence length (train.seq_len)")
  p.add_argument("--batch", type=int, default=None, help="sequences per step (train.batch_size)")
  p.add_argument("--budget", default=None,
                 help="device memory for the planner, e.g. 141GB (default: the device's)")
  p.add_argument("--steps", type=int, default=5,
                 help="timed steps per policy (after 2 untimed), and rounds against full")
  p.add_argument(
      "--policies", default="full,minimal,tiered,planned,none",
      help="run in this order (none last: it may run out of memory); also "
      "planned_hbm: the planner without the host tier")
  p.add_argument("--json", default=None, help="write the report here")
  p.add_argument("--replans", type=int, default=2,
                 help="times to plan again when XLA's compiled peak is over the budget")
  p.add_argument(
      "--analytic-working-set", action="store_true",
      help="plan with the planner's analytic working set instead of compiling "
      "each layer part on this backend (hylora.plan.part_memory)")
  from hylora.core.overrides import split_overrides
  overrides, rest = split_overrides(argv)
  args = p.parse_args(rest)
  args.overrides = overrides
  return args


def _bytes(text: str) -> float:
  from hylora.plan.dry_run import parse_bytes
  return parse_bytes(text)


def _small():
  """The tiny preset cut to one `L L L S` period on a 2 x 4 mesh, short rows."""
  from hylora.core.config import MeshConfig
  from hylora.core.presets import tiny
  cfg = tiny()
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, layers=4, dense_layers=1),
                             mesh=MeshConfig(fsdp=2, expert=4),
                             train=dataclasses.replace(cfg.train, seq_len=64, batch_size=8))


def _config(args):
  from hylora.core.presets import gpu_1
  cfg = _small() if args.small else gpu_1()
  train = {}
  if args.batch:
    train["batch_size"] = args.batch
  if args.seq:
    train["seq_len"] = args.seq
  from hylora.core.overrides import apply_overrides
  cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))
  return apply_overrides(cfg, args.overrides).validate()


def _device_memory(args, small: bool) -> float:
  import jax
  if args.budget:
    return _bytes(args.budget)
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return float(stats["bytes_limit"])
  if small:
    return 0.0  # set from the planner below
  return 141e9


def _pick_sequence(cfg, mesh_shape, budget):
  """The shortest sequence (8K..128K) at which `none` is predicted not to fit."""
  from hylora.core.config import MemoryConfig
  from hylora.plan.remat_planner import estimate_policy
  for seq in (8192, 16384, 32768, 65536, 131072):
    trial = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=seq))
    if not estimate_policy(trial, mesh_shape, budget, MemoryConfig(remat="none")).fits:
      return trial
  return trial


def _random_batch(cfg, seed=0):
  import numpy as np
  b, t = cfg.train.batch_size, cfg.train.seq_len
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, cfg.model.vocab_size, (b, t)).astype(np.int32)
  labels = np.roll(tokens, -1, axis=1)
  labels[:, -1] = -100
  return {
      "tokens": tokens,
      "labels": labels,
      "segment_ids": np.ones((b, t), np.int32),
      "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
  }


def measure(cfg, mesh, params, steps: int, budget: float = 0.0):
  """Compile one train step under cfg.memory; XLA's peak, then the median step time
  (not run when XLA's peak is over a given budget: it would run out of memory).
  Returns the row and the step as a function of no arguments (None where it did not
  run), each call one more step on the state the last one left."""
  import jax
  import numpy as np
  from hylora.plan.dry_run import xla_bytes
  from hylora.train.trainer import Trainer

  trainer = Trainer(cfg, mesh)
  lora0, frozen = params
  lora = jax.tree.map(lambda a: a.copy(), lora0)  # the step donates its adapters
  opt_state = trainer.init_optimizer(lora)
  batch = trainer.put_batch(_random_batch(cfg))
  row, one_step = {}, None
  try:
    compiled = trainer.compile(lora, opt_state, frozen, batch)
    row.update(xla_bytes(compiled), compile_s=round(trainer.compile_seconds, 1))
    if budget and row["xla_peak"] > budget:
      row["error"] = f"XLA peak {row['xla_peak'] / GB:.1f} GB over the budget {budget / GB:.1f} GB"
      return row, None
    state = {"lora": lora, "opt_state": opt_state, "step": 0}

    def one_step():
      i = state["step"]
      state["lora"], state["opt_state"], state["metrics"] = compiled(state["lora"],
                                                                     state["opt_state"], frozen,
                                                                     batch, np.int32(i))
      state["step"] = i + 1
      return state["metrics"]

    row.update(step_ms=round(median_ms(one_step, warmup=1, reps=steps), 2),
               loss=round(float(state["metrics"]["loss"]), 5))
  except Exception as e:  # an OOM is a result here (`none` at a long sequence)
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    one_step = None
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    row["allocator_peak_so_far"] = stats["peak_bytes_in_use"]
  return row, one_step


def main(argv=None) -> int:
  args = _args(sys.argv[1:] if argv is None else argv)
  if args.small:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from meshes.mesh import ensure_cpu_devices
    ensure_cpu_devices(8)
  import jax
  from hylora.core.config import MemoryConfig
  from hylora.core.errors import ConfigError
  from hylora.plan.remat_planner import H200, estimate_policy, plan_memory, replan_after_compile
  from hylora.train import state as st
  from meshes.mesh import build_mesh

  try:
    cfg = _config(args)
    mesh = build_mesh(cfg.mesh)
    mesh_shape = (mesh.shape["fsdp"], mesh.shape["expert"])
    budget = _device_memory(args, args.small)
    if not args.seq and not args.small:
      cfg = _pick_sequence(cfg, mesh_shape, budget)
    working = None
    if not args.analytic_working_set:
      from hylora.plan.part_memory import measured_working_bytes
      from hylora.plan.save_point_sizes import tokens_per_device
      working = measured_working_bytes(cfg, tokens_per_device(cfg, mesh_shape))
    if args.small and not budget:
      # a budget between `full` and `none`, so that the plan has to choose
      lo, hi = (estimate_policy(cfg, mesh_shape, 1e12, MemoryConfig(remat=r), working_bytes=working)
                for r in ("full", "none"))
      budget = (lo.predicted_peak_bytes + hi.predicted_peak_bytes) / 2
    plan = plan_memory(cfg, mesh_shape, budget, working_bytes=working)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(plan.table(), flush=True)

  policies = {
      "none": MemoryConfig(remat="none"),
      "full": MemoryConfig(remat="full"),
      "minimal": MemoryConfig(remat="minimal"),
      "tiered": MemoryConfig(remat="tiered", **HAND_TIERED),
      "planned": plan.policy_config()
  }
  chosen = [p for p in args.policies.split(",") if p]
  # The planner's choice without the host tier shows what the host copies cost or gain.
  hardware = {"planned": H200, "planned_hbm": dataclasses.replace(H200, host_memory_bytes=0)}
  plans = {"planned": plan}
  if "planned_hbm" in chosen:
    plans["planned_hbm"] = plan_memory(cfg, mesh_shape, budget, working_bytes=working,
                                       hardware=hardware["planned_hbm"])
  policies.update({name: p.policy_config() for name, p in plans.items()})
  unknown = [p for p in chosen if p not in policies]
  if unknown:
    print(f"error: --policies: unknown {unknown}; choose from {sorted(policies)}", file=sys.stderr)
    return 2
  report = {
      "device": str(jax.devices()[0]),
      "jax": jax.__version__,
      "preset": cfg.preset,
      "seq_len": cfg.train.seq_len,
      "batch_size": cfg.train.batch_size,
      "mesh": mesh_shape,
      "budget_bytes": budget,
      "plan": plan.policy_config().__dict__,
      "working_bytes": plan.working_bytes,
      "working_compiled": plan.working_compiled,
      "policies": {}
  }
  params = st.init_params(cfg, st.model_parts(cfg), mesh)
  steps = {}  # the policies that ran, for the comparison against full
  for name in chosen:
    policy = policies[name]
    replans = []
    while True:
      predicted = estimate_policy(cfg, mesh_shape, budget, policy, working_bytes=working)
      row = {
          "predicted_peak": predicted.predicted_peak_bytes,
          "predicted_step_ms": float(f"{predicted.predicted_step_seconds * 1e3:.4g}")
      }
      measured, steps[name] = measure(dataclasses.replace(cfg, memory=policy), mesh, params,
                                      args.steps, budget)
      row.update(measured)
      over = row.get("xla_peak", 0) > budget
      if name not in plans or not over or len(replans) == args.replans:
        break
      # XLA needs more than the planner predicted: plan again with its error taken off.
      replans.append({k: row.get(k) for k in ("predicted_peak", "xla_peak")} |
                     {"policy": policy.__dict__})
      plans[name] = replan_after_compile(cfg, mesh_shape, budget, plans[name], row["xla_peak"],
                                         hardware=hardware[name], working_bytes=working)
      print(
          f"XLA peak {row['xla_peak'] / GB:.1f} GB over the budget; planned again:\n" +
          plans[name].table(), flush=True)
      policy = plans[name].policy_config()
    if name in plans:
      row["policy"] = policy.__dict__
    if replans:
      row["replans"] = replans
    report["policies"][name] = row
    print(json.dumps({name: row}, default=str), flush=True)
    if args.json:  # after every policy: a run cut short keeps what it measured
      with open(args.json, "w") as f:
        json.dump(report, f, indent=1, default=str)

  ran = {name: step for name, step in steps.items() if step is not None}
  if "full" in ran and len(ran) > 1:  # every other policy against full, alternating rounds
    try:
      vs = interleaved_ratios({
          n: f for n, f in ran.items() if n != "full"
      }, ran["full"], rounds=args.steps, calls=1)
      report["vs_full_interleaved"] = vs
      for name in ran:
        if name != "full":
          report["policies"][name]["vs_full"] = vs[name]["median"]
    except Exception as e:  # an OOM among alternating policies is reported, not fatal
      report["vs_full_interleaved"] = failed(e)
    print(json.dumps({"vs_full_interleaved": report["vs_full_interleaved"]}), flush=True)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(report, f, indent=1, default=str)
  del steps, ran
  print(f"\n{'policy':<9} {'XLA peak GB':>12} {'predicted GB':>13} {'step ms':>9} "
        f"{'predicted ms':>13} {'vs full':>8}")
  for name, row in report["policies"].items():
    peak = row.get("xla_peak")
    ms = row.get("step_ms")
    vs = 1.0 if name == "full" and ms else row.get("vs_full")
    speed = f"{vs:.2f}x" if vs else "-"
    print(f"{name:<9} {peak / GB if peak else float('nan'):>12.3f} "
          f"{row['predicted_peak'] / GB:>13.3f} {ms if ms else float('nan'):>9.1f} "
          f"{row['predicted_step_ms']:>13.4g} {speed:>8}" +
          (f"  ({row['error'][:60]})" if "error" in row else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())

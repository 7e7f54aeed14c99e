"""Where a layer part's or the whole step's time goes: every compiled instruction's
device time, by source op.

    python -m experiments.profile_part linear             # gpu-1 shapes, one GPU
    python -m experiments.profile_part moe --top 40 --json moe_profile.json
    python -m experiments.profile_part sparse --model.kernels.sparse_attention=reference
    python -m experiments.profile_part step --memory.remat=full

A part (a mixer or FFN: linear, sparse, moe, dense) runs forward + input and LoRA
gradients at the preset's [batch, seq, d_model], as `bench_step` times it; `step` runs
the compiled train step of the preset on one device (its memory policy from the config)
and splits the time into forward, backward and recompute (the remat policy's second
forward, XLA's `rematted_computation`). The JAX
profiler records a few runs; the trace's kernel and copy events (hylora.profile.device_trace)
give the device's busy and idle time and each instruction's summed device time, which
is attributed to the JAX operation that produced it (the HLO `op_name`). Only GPUs
record device events; elsewhere the script says so and lists nothing. XLA's command
buffers (CUDA graphs) are switched off for the run: inside one, the trace sees a
single `command_buffer` instruction instead of the kernels it replays.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

import jax
from flax import nnx

from experiments.bench_step import part_inputs, planned_policy, step_setup
from experiments.timing import median_ms
from hylora.profile import device_trace
from hylora.profile import hlo_schedule
from hylora.core.config import MeshConfig
from hylora.core.errors import ConfigError
from hylora.plan.part_memory import part_gradients
from hylora.model import LoRAParam
from hylora.model.ffn import FFNS
from hylora.model.init import ParamInit
from hylora.model.mixers import MIXERS
from hylora.core.overrides import apply_overrides, split_overrides
from hylora.core.presets import get_preset
from meshes.mesh import add_xla_flags

NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def source_ops(hlo_text: str) -> dict[str, str]:
  """{instruction name: the op_name path of the JAX op behind it} from a compiled module's
  metadata (the opcode where there is no metadata)."""
  out = {}
  for instructions in hlo_schedule.computations(hlo_text).values():
    for inst in instructions:
      op_name = _OP_NAME.search(inst.rest)
      out[inst.name] = op_name.group(1) if op_name else inst.opcode
  return out


def label(op_name: str) -> str:
  """A short name for a table: the last four levels of the op_name path."""
  return "/".join(op_name.split("/")[-4:])


def phase(op_name: str) -> str:
  """forward, backward or recompute, from an instruction's op_name path."""
  if "rematted_computation" in op_name:
    return "recompute"
  return "backward" if "transpose(" in op_name else "forward"


def _part_program(cfg, part: str):
  """(compiled part, run_once) for one mixer / FFN's forward + gradients."""
  table = MIXERS if part in MIXERS else FFNS
  graphdef, lora, rest = nnx.split(table[part](cfg.model, cfg.lora, init=ParamInit(0)), LoRAParam,
                                   ...)
  x, ctx = part_inputs(cfg)
  args = (lora, x, rest, ctx)
  compiled = part_gradients(graphdef).lower(*args).compile()
  return compiled, lambda: compiled(*args)


def _step_program(cfg):
  """(compiled train step, run_once) on one device; run_once threads the state."""
  cfg = dataclasses.replace(cfg, mesh=MeshConfig(fsdp=1, expert=1, devices=0))  # one device
  trainer, lora, opt_state, frozen, packer = step_setup(cfg, jax.devices()[:1])
  batch = trainer.put_batch(packer.next_batch(cfg.train.batch_size))
  compiled = trainer.compile(lora, opt_state, frozen, batch)
  state = {"lora": lora, "opt": opt_state, "step": 0}

  def run_once():  # the step donates the adapters and optimizer state: pass them on
    state["lora"], state["opt"], metrics = trainer.step(state["lora"], state["opt"], frozen, batch,
                                                        state["step"])
    state["step"] += 1
    return metrics

  return compiled, run_once


def profile_part(cfg, part: str, runs: int = 3, repeats: int = 5) -> dict:
  if part == "step":
    compiled, run_once = _step_program(cfg)
  elif part in MIXERS or part in FFNS:
    compiled, run_once = _part_program(cfg, part)
  else:
    raise ConfigError(f"part: unknown {part!r}; choose from "
                      f"{sorted(MIXERS) + sorted(FFNS) + ['step']}")
  jax.block_until_ready(run_once())
  wall_ms = median_ms(run_once, reps=repeats)
  device = device_trace.timeline(device_trace.record(run_once, runs), runs)
  costs = device.by_instruction_us if device else {}
  ops = source_ops(compiled.as_text())
  by_op: dict[str, float] = {}
  by_phase = {"forward": 0.0, "backward": 0.0, "recompute": 0.0}
  for name, us in costs.items():
    op_name = ops.get(name, name)
    by_op[label(op_name)] = by_op.get(label(op_name), 0.0) + us
    by_phase[phase(op_name)] += us
  b, s, d = cfg.train.batch_size, cfg.train.seq_len, cfg.model.d_model
  return {
      "part": part,
      "shape": [b, s, d],
      "wall_ms": wall_ms,
      "profiled_ms": sum(costs.values()) / 1e3,
      "device_busy_ms": device.busy_ms if device else None,
      "device_span_ms": device.span_ms if device else None,
      "longest_idle": device.gaps[:5] if device else [],
      "phases_ms": {
          k: v / 1e3 for k, v in by_phase.items()
      },
      "instructions_us": dict(sorted(costs.items(), key=lambda kv: -kv[1])),
      "ops_us": dict(sorted(by_op.items(), key=lambda kv: -kv[1]))
  }


def format_report(r: dict, top: int) -> str:
  lines = [
      f"{r['part']} at {r['shape']}: {r['wall_ms']:.2f} ms per run; "
      f"instructions sum to {r['profiled_ms']:.2f} ms"
  ]
  if not r["instructions_us"]:
    lines.append("no per-instruction device times on this backend (NVIDIA GPUs only)")
    return "\n".join(lines)
  lines.append(f"device busy {r['device_busy_ms']:.2f} of {r['device_span_ms']:.2f} ms per "
               "traced run; longest idle: " +
               ", ".join(f"{ms:.3f} ms before {after}" for ms, _, after in r["longest_idle"]))
  lines.append("by phase: " + ", ".join(f"{k} {v:.2f} ms" for k, v in r["phases_ms"].items()))
  lines.append(f"{'ms':>8} {'share':>6}  op (summed over its instructions)")
  total = max(r["profiled_ms"], 1e-9)
  for op, us in list(r["ops_us"].items())[:top]:
    lines.append(f"{us / 1e3:>8.3f} {100 * us / 1e3 / total:>5.1f}%  {op}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  p = argparse.ArgumentParser(prog="python -m experiments.profile_part",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("part", help="linear, sparse, moe, dense, or step (the whole train step)")
  p.add_argument("--preset", default="gpu-1")
  p.add_argument("--top", type=int, default=25, help="ops to list")
  p.add_argument("--json", default=None, help="write the whole profile here")
  p.add_argument("--runs", type=int, default=3, help="profiled runs")
  p.add_argument("--repeats", type=int, default=5, help="timed runs")
  p.add_argument("--planned", action="store_true",
                 help="step: under the memory planner's plan for this device (as bench_step)")
  add_xla_flags(NO_COMMAND_BUFFERS)  # before the backend starts
  try:
    overrides, rest = split_overrides(argv)
    args = p.parse_args(rest)
    cfg = apply_overrides(get_preset(args.preset), overrides).validate()
    if args.planned:
      cfg = dataclasses.replace(cfg, memory=planned_policy(cfg, jax.devices()[0]))
    report = profile_part(cfg, args.part, args.runs, args.repeats)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(format_report(report, args.top))
  if args.json:
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())

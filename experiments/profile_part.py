"""Where one layer part's time goes: every compiled instruction's device time, by source op.

    python -m experiments.profile_part linear             # gpu-1 shapes, one GPU
    python -m experiments.profile_part moe --top 40 --json moe_profile.json
    python -m experiments.profile_part sparse --model.kernels.sparse_attention=reference

The part (a mixer or FFN: linear, sparse, moe, dense) runs forward + input and LoRA
gradients at the preset's [batch, seq, d_model], as `bench_step` times it. The JAX
profiler records a few runs; XLA's per-instruction summary of that trace (the one
profile-guided scheduling reads, hylora.pgle) gives each instruction's device time,
which is attributed to the JAX operation that produced it (the HLO `op_name`). Only
NVIDIA GPUs record it; elsewhere the script says so and lists nothing. XLA's command
buffers (CUDA graphs) are switched off for the run: inside one, the profile sees a
single `command_buffer` instruction instead of the kernels it replays.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.bench_step import _median_ms
from hylora.errors import ConfigError
from hylora.layer_memory import part_gradients
from hylora.model import LoRAParam
from hylora.model.context import ForwardContext
from hylora.model.ffn import FFNS
from hylora.model.init import ParamInit
from hylora.model.mixers import MIXERS
from hylora.overrides import apply_overrides, split_overrides
from hylora.pgle import instruction_costs, instruction_profile
from hylora.presets import get_preset

_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (?:\(.*?\)|\S+) ([\w\-]+)\(")
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def source_ops(hlo_text: str) -> dict[str, str]:
  """{instruction name: the JAX op behind it} from a compiled module's metadata (the
  last four levels of the op_name path; the opcode where there is no metadata)."""
  out = {}
  for line in hlo_text.splitlines():
    m = _DEFINITION.match(line)
    if m:
      name, opcode = m.groups()
      op_name = _OP_NAME.search(line)
      out[name] = "/".join(op_name.group(1).split("/")[-4:]) if op_name else opcode
  return out


def profile_part(cfg, part: str, runs: int = 3, repeats: int = 5) -> dict:
  table = MIXERS if part in MIXERS else FFNS
  if part not in table:
    raise ConfigError(f"part: unknown {part!r}; choose from {sorted(MIXERS) + sorted(FFNS)}")
  b, s, d = cfg.train.batch_size, cfg.train.seq_len, cfg.model.d_model
  graphdef, lora, rest = nnx.split(table[part](cfg, init=ParamInit(0)), LoRAParam, ...)
  x = jax.random.normal(jax.random.key(0), (b, s, d), jnp.float32).astype(jnp.bfloat16)
  ctx = ForwardContext(jnp.zeros((b, s), jnp.int32),
                       jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)))
  args = (lora, x, rest, ctx)
  compiled = part_gradients(graphdef).lower(*args).compile()
  wall_ms = _median_ms(compiled, args, repeats)
  costs = instruction_costs(instruction_profile(compiled, args, runs))
  ops = source_ops(compiled.as_text())
  by_op: dict[str, float] = {}
  for name, us in costs.items():
    key = ops.get(name, name)
    by_op[key] = by_op.get(key, 0.0) + us
  return {"part": part, "shape": [b, s, d], "wall_ms": wall_ms,
          "profiled_ms": sum(costs.values()) / 1e3,
          "instructions_us": dict(sorted(costs.items(), key=lambda kv: -kv[1])),
          "ops_us": dict(sorted(by_op.items(), key=lambda kv: -kv[1]))}


def format_report(r: dict, top: int) -> str:
  lines = [f"{r['part']} at {r['shape']}: {r['wall_ms']:.2f} ms per forward + backward; "
           f"instructions sum to {r['profiled_ms']:.2f} ms"]
  if not r["instructions_us"]:
    lines.append("no per-instruction device times on this backend (NVIDIA GPUs only)")
    return "\n".join(lines)
  lines.append(f"{'ms':>8} {'share':>6}  op (summed over its instructions)")
  total = max(r["profiled_ms"], 1e-9)
  for op, us in list(r["ops_us"].items())[:top]:
    lines.append(f"{us / 1e3:>8.3f} {100 * us / 1e3 / total:>5.1f}%  {op}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  p = argparse.ArgumentParser(prog="python -m experiments.profile_part",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("part", help="linear, sparse, moe or dense")
  p.add_argument("--preset", default="gpu-1")
  p.add_argument("--top", type=int, default=25, help="ops to list")
  p.add_argument("--json", default=None, help="write the whole profile here")
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_gpu_enable_command_buffer" not in flags:  # before the backend starts
    os.environ["XLA_FLAGS"] = f"{flags} {NO_COMMAND_BUFFERS}".strip()
  try:
    overrides, rest = split_overrides(argv)
    args = p.parse_args(rest)
    cfg = apply_overrides(get_preset(args.preset), overrides).validate()
    report = profile_part(cfg, args.part)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(format_report(report, args.top))
  if args.json:
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())

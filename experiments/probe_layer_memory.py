"""One layer part's backward memory as XLA compiles it, next to the memory planner's
save-point bytes for the same part: the check behind the planner's working-set term.

  python -m experiments.probe_layer_memory linear moe --seq 16384          # gpu-1 widths
  python -m experiments.probe_layer_memory linear --preset tiny --seq 64   # any preset
  python -m experiments.probe_layer_memory moe --kernels.grouped_matmul=loop   # any field

Each part (a mixer: linear / sparse, or an FFN: moe / dense) is compiled from abstract
shapes (nothing is allocated) as forward + input and LoRA gradients of
[train.batch_size, seq, d_model] on one device, without remat: XLA's temporaries are
the part's activations plus its backward transients. The planner counts only the
save points (the part's work in `hylora.core.architecture`), so the ratio says how much the
backward holds beyond them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path


def probe(cfg, part: str) -> dict:
  """XLA's compiled bytes for one part's forward + backward, and the planner's figure."""
  from hylora.core.architecture import FFN_BLOCKS, MIXER_BLOCKS
  from hylora.plan.part_memory import compiled_part

  b, seq = cfg.train.batch_size, cfg.train.seq_len
  memory = compiled_part(cfg, part, b, seq).memory_analysis()
  block = MIXER_BLOCKS[part] if part in MIXER_BLOCKS else FFN_BLOCKS[part]
  planner = sum(w.nbytes for w in block.work(cfg, b * seq))  # this part's save points
  return {
      "part": part,
      "batch": b,
      "seq": seq,
      "xla_temp_bytes": memory.temp_size_in_bytes,
      "xla_argument_bytes": memory.argument_size_in_bytes,
      "planner_save_point_bytes": planner,
      "ratio": memory.temp_size_in_bytes / planner if planner else float("nan")
  }


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  from hylora.core.errors import ConfigError
  from hylora.core.overrides import apply_overrides, split_overrides
  from hylora.core.presets import get_preset

  p = argparse.ArgumentParser(prog="python -m experiments.probe_layer_memory",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("parts", nargs="+", help="linear, sparse, moe, dense")
  p.add_argument("--preset", default="gpu-1")
  p.add_argument("--seq", type=int, default=None, help="train.seq_len")
  p.add_argument("--json", default=None, help="write the rows here")
  try:
    overrides, rest = split_overrides(argv)
    args = p.parse_args(rest)
    cfg = get_preset(args.preset)
    if args.seq:
      cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=args.seq))
    cfg = apply_overrides(cfg, overrides).validate()
    rows = [probe(cfg, part) for part in args.parts]
  except (ConfigError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"{'part':<8} {'tokens':>8} {'XLA temp GB':>12} {'planner GB':>11} {'ratio':>6}")
  for r in rows:
    print(f"{r['part']:<8} {r['batch'] * r['seq']:>8} {r['xla_temp_bytes'] / 1e9:>12.2f} "
          f"{r['planner_save_point_bytes'] / 1e9:>11.2f} {r['ratio']:>6.2f}")
  if args.json:
    Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())

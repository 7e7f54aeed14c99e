"""LoRA fine-tuning of the hybrid-attention MoE model: the main command.

  python -m experiments.lora_2p8t                      # tiny preset, 8 simulated CPU devices
  python -m experiments.lora_2p8t --preset gpu-1 --steps 50 --out runs/gpu1
  python -m experiments.lora_2p8t --model.moe.top_k=4 --lora.rank=8
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _parser(epilog: str = "") -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m experiments.lora_2p8t", description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog)
  p.add_argument("--preset", default=None,
                 help="tiny (default: 8 simulated CPU devices), gpu-1 (one GPU), 2p8t")
  p.add_argument("--steps", type=int, default=None, help="optimizer steps (train.steps)")
  p.add_argument("--out", default=None, help="output folder (default runs/<preset>-<time>)")
  p.add_argument("--reference", action="store_true",
                 help="run every op on its plain-JAX reference implementation")
  p.add_argument("--devices", type=int, default=None,
                 help="simulate this many CPU devices (mesh.devices)")
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  return p


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  from hylora.errors import ConfigError, DataError
  from hylora.overrides import apply_overrides, describe, split_overrides
  from hylora.presets import PRESETS, get_preset

  try:
    overrides, rest = split_overrides(argv)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if "-h" in rest or "--help" in rest:
    preset = "tiny"
    if "--preset" in rest and rest.index("--preset") + 1 < len(rest):
      preset = rest[rest.index("--preset") + 1]
    epilog = ("presets: " + ", ".join(PRESETS) + "\n\nconfig fields (override with "
              f"--field=value; defaults of the {preset!r} preset):\n")
    try:
      epilog += describe(get_preset(preset))
    except ConfigError as e:
      epilog += f"  ({e})"
  else:
    epilog = ""
  args = _parser(epilog).parse_args(rest)

  try:
    cfg = get_preset(args.preset or "tiny")
    if args.devices is not None:
      overrides.setdefault("mesh.devices", str(args.devices))
    if args.steps is not None:
      overrides.setdefault("train.steps", str(args.steps))
    if args.reference:
      for field in ("linear_attention", "sparse_attention", "topk_indices", "grouped_matmul",
                    "cross_entropy"):
        overrides.setdefault(f"kernels.{field}", "reference")
    cfg = apply_overrides(cfg, overrides).validate()
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  if cfg.mesh.devices > 0:
    # Simulated devices: run on the host CPU, whatever accelerators exist.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from meshes.mesh import ensure_cpu_devices
    ensure_cpu_devices(cfg.mesh.devices)

  from hylora.train.run import train

  out = args.out or os.path.join("runs", f"{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
  try:
    summary = train(cfg, out, progress=not args.quiet)
  except (ConfigError, DataError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"\n{summary['preset']}: {summary['steps']} steps on {summary['devices']} devices "
        f"(mesh {summary['mesh']}), loss {summary['first_loss']:.4f} -> "
        f"{summary['final_loss']:.4f}, {summary['steps_per_s']:.2f} steps/s, "
        f"{summary['tokens_per_s']:.0f} tokens/s, compile {summary['compile_seconds']:.1f} s")
  print(f"outputs: {out}/ (metrics.jsonl, config.json, loss.png, summary.json)")
  return 0


if __name__ == "__main__":
  sys.exit(main())

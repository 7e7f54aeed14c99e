"""LoRA fine-tuning of the hybrid-attention MoE model: the main command.

  python -m experiments.lora_2p8t                      # tiny preset, 8 simulated CPU devices
  python -m experiments.lora_2p8t --preset gpu-1 --steps 50 --out runs/gpu1
  python -m experiments.lora_2p8t --model.moe.top_k=4 --lora.rank=8
  python -m experiments.lora_2p8t --dry-run             # compile 2p8t for 128 simulated devices
  python -m experiments.lora_2p8t --data chats.jsonl   # image + text conversations
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time


def _parser(epilog: str = "") -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m experiments.lora_2p8t",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog)
  p.add_argument(
      "--preset", default=None,
      help="tiny (default: 8 simulated CPU devices), gpu-1 (one GPU), 2p8t, "
      "kimi-linear, deepseek-v3.2, kimi-k3")
  p.add_argument("--steps", type=int, default=None, help="optimizer steps (train.steps)")
  p.add_argument(
      "--data", default=None, metavar="PATH",
      help="training data (train.data): a .jsonl of conversations / text records "
      "(docs/multimodal.md) or of token ids, or a .npy of token ids; default: "
      "the synthetic source")
  p.add_argument("--out", default=None, help="output folder (default runs/<preset>-<time>)")
  p.add_argument("--reference", action="store_true",
                 help="run every op on its plain-JAX reference implementation")
  p.add_argument(
      "--devices", type=int, default=None, metavar="N",
      help="use the host's first N devices; on a host without accelerators, N simulated "
      "CPU devices (mesh.devices; with several processes: per process)")
  p.add_argument(
      "--device-memory", default=None, metavar="SIZE",
      help="HBM per device the plan is made for, e.g. 141GB (memory.device_memory; "
      "default 141GB, less where the device reports less)")
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  ck = p.add_argument_group("weights and checkpoints (docs/checkpoints.md)")
  ck.add_argument(
      "--base-weights", default=None, metavar="DIR",
      help="base weights: a Hugging Face-layout folder of safetensors shards + "
      "config.json (checkpoint.base_weights): a released checkpoint (Kimi Linear, "
      "DeepSeek-V3.2, Kimi K3) or one written here; its config.json sets the model "
      "architecture; default: random weights")
  ck.add_argument(
      "--ignore-tensors", default=None, metavar="REGEX",
      help="checkpoint tensors that are not part of the model (checkpoint.ignore_tensors); "
      "a family's own extras (MTP layers, another vision tower) are skipped already")
  ck.add_argument(
      "--checkpoint-every", type=int, default=None, metavar="N",
      help="save a checkpoint every N steps under --out (checkpoint.every; one is "
      "always saved after the last step)")
  ck.add_argument("--resume", action="store_true",
                  help="continue from the latest checkpoint in --out up to --steps in total")
  ck.add_argument("--export-adapter", default=None, metavar="DIR",
                  help="after training, write the adapter in the PEFT layout to DIR")
  ck.add_argument("--merge", action="store_true",
                  help="with --export-adapter: also write the merged model to DIR/merged")
  ck.add_argument(
      "--merge-dequantized", action="store_true",
      help="with --merge and a packed (quantized) base: write the merged model as a bf16 "
      "copy, the base dequantized (checkpoint.merge_dequantized; it needs the bf16 size "
      "on disk)")
  mh = p.add_argument_group("multi-host (default: from SLURM variables when SLURM_NTASKS > 1)")
  mh.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                  help="address of process 0's coordination service")
  mh.add_argument("--num-processes", type=int, default=None)
  mh.add_argument("--process-id", type=int, default=None)
  mh.add_argument("--heartbeat-timeout", type=int, default=30, metavar="S",
                  help="a process silent this long counts as dead: the others stop (default 30)")
  mh.add_argument(
      "--distributed-timeout", type=int, default=None, metavar="S",
      help="how long processes wait for each other (and for the coordinator) to start "
      "(default 300)")
  dry = p.add_argument_group("dry run (docs/dry_run.md)")
  dry.add_argument(
      "--dry-run", action="store_true",
      help="compile the real step for simulated devices from abstract shapes and "
      "report memory (default preset 2p8t on its 2 x 64 mesh)")
  dry.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
  dry.add_argument("--sweep", action="store_true",
                   help="also compile variants (seq, batch, remat) and print a table")
  dry.add_argument("--no-compile", action="store_true",
                   help="counts, shardings and analytic bytes only")
  return p


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  from hylora.core.config import KernelConfig
  from hylora.core.errors import ConfigError, DataError
  from hylora.core.overrides import apply_overrides, describe, split_overrides
  from hylora.core.presets import PRESETS, get_preset

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
    cfg = get_preset(args.preset or ("2p8t" if args.dry_run else "tiny"))
    for flag, field in ((args.devices, "mesh.devices"), (args.steps, "train.steps"),
                        (args.data, "train.data"), (args.base_weights, "checkpoint.base_weights"),
                        (args.ignore_tensors, "checkpoint.ignore_tensors"), (args.checkpoint_every,
                                                                             "checkpoint.every")):
      if flag is not None:
        overrides.setdefault(field, str(flag))
    if args.device_memory is not None:
      from hylora.plan.dry_run import parse_bytes
      overrides.setdefault("memory.device_memory", repr(parse_bytes(args.device_memory)))
    if overrides.get("checkpoint.base_weights"):
      # The checkpoint's config.json sets the architecture; explicit overrides still win.
      from hylora.core.families import adopt_checkpoint
      cfg = adopt_checkpoint(cfg, overrides["checkpoint.base_weights"])
    if args.resume and args.out is None:
      raise ConfigError("--resume: name the run's folder with --out")
    if args.merge and args.export_adapter is None:
      raise ConfigError("--merge: goes with --export-adapter DIR")
    if args.merge_dequantized:
      if not args.merge:
        raise ConfigError("--merge-dequantized: goes with --merge")
      overrides.setdefault("checkpoint.merge_dequantized", "true")
    if args.distributed_timeout is not None and args.distributed_timeout < 1:
      raise ConfigError(f"--distributed-timeout: must be >= 1 s, got {args.distributed_timeout}")
    from hylora.io.distributed import resolve
    group = resolve(args.coordinator, args.num_processes, args.process_id)
    if args.reference:
      for field in dataclasses.fields(KernelConfig):
        overrides.setdefault(f"kernels.{field.name}", "reference")
    cfg = apply_overrides(cfg, overrides).validate()  # every value, before anything is built
    if args.merge and cfg.model.quantization.format != "none" and not (
        cfg.checkpoint.merge_dequantized):
      raise ConfigError(f"--merge: the base is packed ({cfg.model.quantization.format}); the "
                        "merged model can only be written in bf16: add --merge-dequantized")
    from hylora.plan.run_plan import check_choices
    check_choices(cfg)
    if args.dry_run:
      from hylora.plan.dry_run_setup import dry_run_config, dry_run_target, set_xla_flags
      target = dry_run_target(cfg)
      cfg = dry_run_config(cfg)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  from meshes.mesh import request_devices, use_simulated_devices
  if args.dry_run:
    set_xla_flags()
    use_simulated_devices(cfg.mesh.devices)  # a dry run compiles for simulated devices
  else:
    request_devices(cfg.mesh.devices)
  if group is not None:
    from hylora.io.distributed import DEFAULT_TIMEOUT_S, CoordinatorUnreachable, initialize
    try:
      initialize(group, timeout_s=args.distributed_timeout or DEFAULT_TIMEOUT_S,
                 heartbeat_timeout_s=args.heartbeat_timeout, cpu_collectives=cfg.mesh.devices > 0)
    except CoordinatorUnreachable as e:
      print(f"error: process {group.process_id} of {group.num_processes}: {e}", file=sys.stderr)
      return 1

  from hylora.plan.run_plan import resolve as resolve_plan
  from hylora.train.mesh import run_mesh
  import jax
  try:
    mesh = run_mesh(cfg.mesh)
    plan = resolve_plan(cfg, mesh, target=target if args.dry_run else None)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if jax.process_index() == 0:
    host = len(jax.devices())
    if mesh.size < host:
      print(f"using the first {mesh.size} of this host's {host} devices", flush=True)
    print(plan.text(), flush=True)

  if args.dry_run:
    from hylora.plan.dry_run import command
    try:
      return command(cfg, plan=plan, json_path=args.json, compile_step=not args.no_compile,
                     run_sweep=args.sweep)
    except ConfigError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2

  from hylora.train.run import train

  out = args.out or os.path.join("runs", f"{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
  from hylora.core.errors import CheckpointError, TrainingHalted, WeightsError
  try:
    summary = train(cfg, out, progress=not args.quiet, resume=args.resume,
                    export_adapter=args.export_adapter, merge=args.merge, plan=plan)
  except (ConfigError, DataError, WeightsError, CheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except TrainingHalted as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  except Exception as e:  # noqa: BLE001
    if group is None or type(e).__name__ != "JaxRuntimeError":
      raise
    print(
        f"error: process {group.process_id} of {group.num_processes} lost contact with the "
        f"others ({str(e).strip().splitlines()[0][:300]})", file=sys.stderr, flush=True)
    os._exit(1)  # no orderly jax.distributed shutdown: it would wait for the dead peer
  print(f"\n{summary['preset']}: {summary['steps']} steps on {summary['devices']} devices "
        f"(mesh {summary['mesh']}), loss {summary['first_loss']:.4f} -> "
        f"{summary['final_loss']:.4f}, {summary['steps_per_s']:.2f} steps/s, "
        f"{summary['tokens_per_s']:.0f} tokens/s, compile {summary['compile_seconds']:.1f} s")
  print(f"outputs: {out}/ (metrics.jsonl, config.json, plan.json, loss.png, summary.json)")
  if args.export_adapter:
    print(f"adapter: {args.export_adapter}/ (adapter_config.json, adapter_model.safetensors" +
          (", merged/" if args.merge else "") + ")")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Ahead-of-time dry run: lower and compile the real LoRA train step for a mesh of
simulated devices from abstract shapes only, and report where the memory goes.

The step is `Trainer.jitted_step`, the one a real run executes (model, LoRA, loss,
gradient accumulation, AdamW update). Its inputs are `jax.ShapeDtypeStruct`s carrying
the run's shardings: parameters from `state.abstract_arrays`, the optimizer state from
`jax.eval_shape(optimizer.init)` with `Trainer.optimizer_sharding`, the batch with
`Trainer.batch_sharding`. No weight is ever materialised. What is compiled is the run's
own plan (`hylora.plan.run_plan`), with the stand-ins and XLA:CPU flags of
`hylora.plan.dry_run_setup`, which the report names.

Memory figures (bytes per device):
  weights / lora / grads / optimizer / batch: the per-device shard of every array, from
    its sharding (grads: one fp32 accumulator per LoRA factor, as the step keeps).
  xla_*: `compiled.memory_analysis()` of XLA:CPU for the simulated mesh;
    xla_peak = arguments + outputs - aliased + temporaries (donated LoRA and optimizer
    buffers are reused for the outputs, so they are counted once).
  analytic_arguments = weights + lora + optimizer + batch (what XLA's arguments must be).
  analytic_peak = analytic_arguments + grads + layer-input checkpoints, a lower bound:
    under remat the residual stream entering every layer is kept (bf16), everything
    else of a layer is recomputed; the working set of the layer being recomputed and
    the gathered FSDP shards are on top (that is what `xla_temporaries` measures).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import resource
import sys
import time

import jax
import numpy as np

from hylora.plan import param_count
from hylora.quant import is_packed
from hylora.core.architecture import parameter_kind, stacked_position
from hylora.core.config import Config
from hylora.plan.compiled_program import (captured_stderr, involuntary_replications, largest_values)
from hylora.plan.dry_run_report import format_report, format_sweep
from hylora.plan.dry_run_setup import dry_run_target, set_xla_flags
from hylora.plan import run_plan
from hylora.core.errors import ConfigError
from hylora.train import state as st
from hylora.train.step import BATCH_KEYS

GB = 1e9
DEFAULT_DEVICE_MEMORY = 141 * GB  # one H200
LARGE_PER_LAYER = 1 << 20  # arrays with at least this many elements per layer are "large"

# ---- inputs ---------------------------------------------------------------------------


def abstract_inputs(trainer) -> tuple[dict, dict, dict, dict]:
  """(lora, opt_state, frozen, batch) as sharded ShapeDtypeStructs."""
  lora, frozen = st.abstract_arrays(trainer.parts, trainer.mesh)
  opt_abstract = jax.eval_shape(trainer.optimizer.init, lora)
  opt_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                           opt_abstract, trainer.optimizer_sharding(lora))
  tc = trainer.cfg.train
  batch = {
      k:
          jax.ShapeDtypeStruct((tc.batch_size, tc.seq_len), np.int32,
                               sharding=trainer.batch_sharding) for k in BATCH_KEYS
  }
  return lora, opt_state, frozen, batch


def shard_shape(a) -> tuple[int, ...]:
  return tuple(a.sharding.shard_shape(a.shape))


def shard_bytes(a) -> int:
  return math.prod(shard_shape(a)) * np.dtype(a.dtype).itemsize


def tree_bytes(tree) -> int:
  return sum(shard_bytes(a) for a in jax.tree.leaves(tree))


# ---- shardings ------------------------------------------------------------------------


def _spec_text(a) -> str:
  """The mesh axes of each dimension, e.g. "[-, expert, fsdp, -]"."""
  spec = tuple(a.sharding.spec) + (None,) * (len(a.shape) - len(a.sharding.spec))
  dims = ["-" if s is None else (s if isinstance(s, str) else "+".join(s)) for s in spec]
  return "[" + ", ".join(dims) + "]"


def array_table(lora: dict, frozen: dict) -> list[dict]:
  """One row per parameter array: where it sits, its kind and how it is split."""
  rows = []
  for tree_name, tree in (("frozen", frozen), ("lora", lora)):
    for keys, leaf in param_count.leaves(tree):
      rows += _array_rows(tree_name, keys, leaf)
  return rows


def _array_rows(tree_name: str, keys: tuple, leaf) -> list[dict]:
  """A parameter's row, or a packed weight's two (its codes and their scales)."""
  if is_packed(leaf):
    return [
        dict(row, path=row["path"] + "/" + part, dtype=f"{leaf.format} {row['dtype']}")
        for part, array in (("codes", leaf.codes), ("scales", leaf.scales))
        for row in _array_rows(tree_name, keys, array)
    ]
  a = leaf
  stacked = stacked_position(keys) is not None  # a leading layers axis
  per_layer = math.prod(a.shape[1:] if stacked else a.shape)
  axes = sorted(
      {n for s in a.sharding.spec if s is not None for n in ((s,) if isinstance(s, str) else s)})
  return [{
      "tree": tree_name,
      "path": "/".join(keys),
      "kind": parameter_kind(keys),
      "shape": list(a.shape),
      "dtype": str(np.dtype(a.dtype)),
      "spec": _spec_text(a),
      "mesh_axes": axes,
      "shard_shape": list(shard_shape(a)),
      "split": math.prod(a.shape) // max(1, math.prod(shard_shape(a))),
      "large": per_layer >= LARGE_PER_LAYER,
  }]


def sharding_summary(rows: list[dict]) -> dict:
  """{kind: [{"spec", "arrays", "split", "tree"}]}: the distinct layouts of each kind."""
  out: dict[str, dict] = {}
  for r in rows:
    key = (r["tree"], r["spec"], r["split"])
    kind = out.setdefault(r["kind"], {})
    kind[key] = kind.get(key, 0) + 1
  return {
      kind: [{
          "tree": t,
          "spec": s,
          "split": split,
          "arrays": n
      } for (t, s, split), n in sorted(layouts.items(), key=lambda kv: -kv[1])
            ] for kind, layouts in out.items()
  }


# ---- memory ---------------------------------------------------------------------------


def tokens_per_device(batch: dict) -> int:
  """Tokens each device processes per step: the batch shard it holds."""
  return math.prod(shard_shape(batch["tokens"]))


def micro_batch_tokens(cfg: Config, mesh) -> int:
  """Tokens of one micro-batch on one device, as the memory planner counts them (the
  activation rules applied to a micro-batch's [rows, seq])."""
  from hylora.plan.save_point_sizes import tokens_per_device as planned
  return planned(cfg, dict(mesh.shape))


def analytic_bytes(cfg: Config, lora, opt_state, frozen, batch, mesh) -> dict:
  weights, adapters, optimizer = tree_bytes(frozen), tree_bytes(lora), tree_bytes(opt_state)
  batch_bytes = tree_bytes(batch)
  arguments = weights + adapters + optimizer + batch_bytes + 4  # + the int32 step
  grads = sum(math.prod(shard_shape(a)) * 4 for a in jax.tree.leaves(lora))  # fp32
  micro_tokens = micro_batch_tokens(cfg, mesh)
  checkpoints = (cfg.model.layers * micro_tokens * cfg.model.d_model *
                 2 if cfg.memory.remat != "none" else 0)
  return {
      "weights": weights,
      "lora": adapters,
      "grads": grads,
      "optimizer": optimizer,
      "batch": batch_bytes,
      "analytic_arguments": arguments,
      "analytic_checkpoints": checkpoints,
      "analytic_peak": arguments + grads + checkpoints
  }


def xla_bytes(compiled) -> dict:
  m = compiled.memory_analysis()
  peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes +
          m.temp_size_in_bytes)
  return {
      "xla_arguments": m.argument_size_in_bytes,
      "xla_outputs": m.output_size_in_bytes,
      "xla_aliased": m.alias_size_in_bytes,
      "xla_temporaries": m.temp_size_in_bytes,
      "xla_peak": peak
  }


def memory_plan(cfg: Config, mesh, device_memory: float) -> dict | None:
  """The memory planner's GPU-side prediction for this policy and its best plan, when
  `hylora.plan.remat_planner` is present (None otherwise; its failure is reported, not raised)."""
  try:
    from hylora.plan import remat_planner as planner
  except ImportError:
    return None
  shape = (mesh.shape["fsdp"], mesh.shape["expert"])
  try:
    this = planner.estimate_policy(cfg, shape, device_memory)
    best = planner.plan_memory(cfg, shape, device_memory * (1 - cfg.memory.plan_headroom))
  except Exception as e:  # the planner must never stop a dry run
    return {"error": f"{type(e).__name__}: {e}"}
  return {
      "policy": cfg.memory.remat,
      "predicted_peak": this.predicted_peak_bytes,
      "fits": bool(this.fits),
      "best_plan_peak": best.predicted_peak_bytes,
      "best_plan_fits": bool(best.fits),
      "best_plan": best.table()
  }


def host_peak_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def parse_bytes(text: str) -> float:
  """"141GB", "141 GiB", "1.5e11", "141" (GB) -> bytes."""
  m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B|B)?\s*", str(text))
  try:
    value = float(m.group(1)) if m else float("nan")
  except ValueError:
    value = float("nan")
  if not m or not math.isfinite(value) or value <= 0:
    raise ConfigError(f"--device-memory: expected a positive size like 141GB, got {text!r}")
  unit = m.group(2) or "GB"
  scale = {
      "B": 1,
      "KB": 1e3,
      "MB": 1e6,
      "GB": 1e9,
      "TB": 1e12,
      "KiB": 2**10,
      "MiB": 2**20,
      "GiB": 2**30,
      "TiB": 2**40
  }[unit]
  return value * scale


# ---- the dry run ----------------------------------------------------------------------


def check_devices(cfg: Config) -> None:
  want, have = cfg.mesh.devices, len(jax.devices())
  if want > 0 and have != want:
    raise ConfigError(f"mesh.devices: asked for {want} simulated devices but JAX started with "
                      f"{have} (is XLA_FLAGS forcing another host device count?)")


def dry_run(cfg: Config, device_memory: float = DEFAULT_DEVICE_MEMORY, *, compile_step: bool = True,
            target: str | None = None, plan: run_plan.RunPlan | None = None) -> dict:
  """Builds the mesh, compiles the step of `plan` (default: the run's plan for `target`,
  itself by default `dry_run_target(cfg)`) from abstract inputs, returns the report."""
  from hylora.train.trainer import Trainer
  from hylora.train.mesh import run_mesh

  cfg = cfg.validate()
  check_devices(cfg)
  mesh = run_mesh(cfg.mesh)
  plan = plan or run_plan.resolve(cfg, mesh, target=target or dry_run_target(cfg))
  trainer = Trainer(cfg, mesh, plan)
  cfg = trainer.cfg  # the plan's choices in place of "auto"
  lora, opt_state, frozen, batch = abstract_inputs(trainer)
  counts = param_count.count_params(cfg, lora, frozen)
  rows = array_table(lora, frozen)
  memory = analytic_bytes(cfg, lora, opt_state, frozen, batch, mesh)
  resident = memory["analytic_arguments"] + memory["grads"]
  if resident > device_memory:
    raise PlanDoesNotFit(
        f"--device-memory: {device_memory / GB:.1f} GB per device cannot hold the resident "
        f"state alone ({resident / GB:.1f} GB: base weights {memory['weights'] / GB:.1f}, "
        f"LoRA params+grads+optimizer "
        f"{(memory['lora'] + memory['grads'] + memory['optimizer']) / GB:.2f}); "
        f"use more devices or a larger device memory")
  replicated, largest = [], []
  if compile_step:
    print(f"compiling the train step for {mesh.size} simulated devices ...", flush=True)
    with captured_stderr() as log:
      trainer.compile(lora, opt_state, frozen, batch)  # the run's own lower + compile
    replicated = involuntary_replications(log.read())
    memory.update(xla_bytes(trainer.compiled))
    largest = largest_values(trainer.compiled.as_text())
  planner = memory_plan(cfg, mesh, device_memory)
  # The verdict's figure: XLA's peak when compiled, else the planner's GPU-side
  # prediction, else the analytic lower bound.
  if compile_step:
    source = "xla_peak"
  elif planner is not None and "error" not in planner:
    source = "planner_peak"
    memory["planner_peak"] = planner["predicted_peak"]
  else:
    source = "analytic_peak"
  peak = memory[source]
  m, tc = cfg.model, cfg.train
  return {
      "preset": cfg.preset,
      "base_format": m.quantization.format,
      "params_total": counts["total"],
      "params_active_per_token": counts["active"],
      "params_lora": counts["lora"],
      "params_by_kind": counts["by_kind"],
      "devices": mesh.size,
      "mesh": {
          name: int(size) for name, size in mesh.shape.items()
      },
      "bytes_per_device": memory,
      "compile_seconds": trainer.compile_seconds if compile_step else None,
      "program_fingerprint": trainer.program_fingerprint,
      "compiled": compile_step,
      "device_memory": device_memory,
      "fits": bool(peak <= device_memory),
      "peak_source": source,
      "memory_plan": planner,
      "step": {
          "layers": m.layers,
          "batch_size": tc.batch_size,
          "seq_len": tc.seq_len,
          "grad_accum": tc.grad_accum,
          "tokens_per_device": tokens_per_device(batch),
          "micro_batch_tokens_per_device": micro_batch_tokens(cfg, mesh),
          "batch_spec": _spec_text(batch["tokens"]),
          "remat": cfg.memory.remat,
          "dispatch": m.moe.dispatch,
          "capacity_factor": m.moe.capacity_factor,
          "backend": jax.default_backend()
      },
      "plan": plan.to_dict(),
      "plan_text": plan.text(),
      "implementations": {
          o.op: o.implementation for o in plan.ops
      },
      "stand_ins": plan.stand_ins(),
      "partitioner_replications": replicated,
      "largest_values": largest,
      "shardings": sharding_summary(rows),
      "arrays": rows,
      "host_peak_bytes": host_peak_bytes(),
  }


class PlanDoesNotFit(ConfigError):
  """The plan cannot fit the device memory even before compiling."""


# ---- sweep ----------------------------------------------------------------------------


def sweep_variants(cfg: Config) -> list[tuple[str, Config]]:
  """One factor at a time around `cfg`: sequence length, batch, remat policy."""
  tc, chunk = cfg.train, cfg.model.linear_attention.chunk_size
  out = [("base", cfg)]
  for div in (4, 2):
    seq = max(chunk, tc.seq_len // div // chunk * chunk)
    if seq != tc.seq_len:
      out.append((f"seq/{div}", dataclasses.replace(cfg, train=dataclasses.replace(tc,
                                                                                   seq_len=seq))))
  half = tc.batch_size // 2
  if half >= tc.grad_accum and half % tc.grad_accum == 0:
    out.append(("batch/2", dataclasses.replace(cfg, train=dataclasses.replace(tc,
                                                                              batch_size=half))))
  for remat in ("full", "minimal", "none"):
    if remat != cfg.memory.remat:
      out.append((f"remat={remat}",
                  dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, remat=remat))))
  return out


def _sweep_row(label: str, r: dict) -> dict:
  b, s, plan = r["bytes_per_device"], r["step"], r.get("memory_plan") or {}
  return {
      "variant": label,
      "seq_len": s["seq_len"],
      "batch_size": s["batch_size"],
      "tokens_per_device": s["tokens_per_device"],
      "remat": s["remat"],
      "xla_temporaries": b.get("xla_temporaries"),
      "xla_peak": b.get("xla_peak"),
      "analytic_peak": b["analytic_peak"],
      "planner_peak": plan.get("predicted_peak"),
      "fits": r["fits"],
      "compile_seconds": r["compile_seconds"]
  }


def sweep(cfg: Config, device_memory: float, *, compile_step: bool = True, base: dict | None = None,
          log=print, target: str | None = None) -> list[dict]:
  """One row per `sweep_variants` entry; `base`: the report of `cfg` itself, if made."""
  rows = []
  for label, variant in sweep_variants(cfg):
    start = time.perf_counter()
    if label == "base" and base is not None:
      rows.append(_sweep_row(label, base))
      continue
    try:
      r = dry_run(variant, device_memory, compile_step=compile_step, target=target)
    except PlanDoesNotFit as e:
      s = variant.train
      rows.append({
          "variant": label,
          "seq_len": s.seq_len,
          "batch_size": s.batch_size,
          "remat": variant.memory.remat,
          "fits": False,
          "note": str(e)
      })
      continue
    rows.append(_sweep_row(label, r))
    log(f"  sweep {label}: done ({time.perf_counter() - start:.0f} s)")
  return rows


# ---- command line ---------------------------------------------------------------------


def command(cfg: Config, *, plan: run_plan.RunPlan, json_path: str | None = None,
            compile_step: bool = True, run_sweep: bool = False) -> int:
  """`--dry-run` of `plan` (printed already): prints the report (and the sweep table);
  0 fits, 1 does not fit. The verdict's budget is the plan's (memory.device_memory)."""
  memory = cfg.memory.device_memory
  try:
    report = dry_run(cfg, memory, compile_step=compile_step, plan=plan)
  except PlanDoesNotFit as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(format_report(report), flush=True)
  if run_sweep:
    print(
        "\nhow the peak moves (one factor at a time" +
        ("; each row is a compile):" if compile_step else "; not compiled):"), flush=True)
    report["sweep"] = sweep(cfg, memory, compile_step=compile_step, base=report, target=plan.target)
    print(format_sweep(report["sweep"], memory))
    report["host_peak_bytes"] = host_peak_bytes()
  if json_path:
    with open(json_path, "w") as f:
      json.dump(report, f, indent=1)
      f.write("\n")
  return 0 if report["fits"] else 1

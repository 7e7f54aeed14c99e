"""A training run: the loop with a live progress bar, `metrics.jsonl`, the resolved
config, a loss plot, and a final summary."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from hylora.io import peft_export
from hylora.io.checkpoint import (Checkpoints, Position, data_state, restore_data, stream_snapshot,
                                  trim_metrics)
from hylora.core.config import Config
from hylora.io.distributed import local_rows
from hylora.core.errors import ConfigError, TrainingHalted
from hylora.core.overrides import to_dict
from hylora.data.stream import open_stream
from hylora.train.balancer import ExpertBalancer
from hylora.train.trainer import Trainer
from hylora.train.mesh import run_mesh


def write_config(cfg: Config, out: Path) -> None:
  out.mkdir(parents=True, exist_ok=True)
  (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")


def plot_loss(metrics_path: Path, png_path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
  fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
  ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1.5)
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (nats/token)")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(png_path)
  plt.close(fig)


def train(cfg: Config, out_dir: str | Path, *, progress: bool = True, resume: bool = False,
          export_adapter: str | Path | None = None, merge: bool = False, plan=None) -> dict:
  """Trains to `train.steps` total steps; `resume` continues from the latest checkpoint
  under `out_dir` (docs/checkpoints.md); `export_adapter` writes the PEFT adapter at
  the end (with `merge`, also the merged model). `plan`: the run's resolved choices
  (hylora.plan.run_plan.resolve, as the main command makes them), written beside
  config.json as plan.json."""
  cfg = cfg.validate()
  out = Path(out_dir)
  primary = jax.process_index() == 0  # one process writes the run's files
  mesh = run_mesh(cfg.mesh)
  tc, cc = cfg.train, cfg.checkpoint
  stream = open_stream(cfg)  # before the model: bad data fails fast
  ckpt = Checkpoints(out, every=cc.every, keep=cc.keep, async_save=cc.async_save)
  position, latest = Position(), ckpt.latest()
  if latest is not None and not resume:
    raise ConfigError(f"--out {out}: already holds checkpoints (latest: step {latest}); pass "
                      "--resume to continue that run, or choose another --out")
  if latest is not None:
    ckpt.check_config(latest, cfg)  # a mismatch fails before the model is built
  if primary:
    write_config(cfg, out)
    if plan is not None:
      plan.write(out)
  trainer = Trainer(cfg, mesh, plan)
  lora, opt_state, frozen = trainer.init(base_weights=cc.base_weights)
  if latest is not None:
    abstract = lambda tree: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    lora, opt_state, position = ckpt.restore(latest, cfg, abstract(lora), abstract(opt_state))
    stream = restore_data(stream, position.data)
  balancer = ExpertBalancer(trainer.cfg, mesh, frozen)
  frozen = balancer.restore(position.balance, frozen)  # a checkpoint's expert placement
  metrics_path = out / "metrics.jsonl"
  if primary:
    trim_metrics(metrics_path, position.step)
  stream.keep_rows(local_rows(trainer.batch_sharding, (tc.batch_size, tc.seq_len)))
  bar = tqdm(range(position.step, tc.steps), desc=f"{cfg.preset} on {mesh.size} devices",
             disable=not (progress and primary), dynamic_ncols=True, initial=position.step,
             total=tc.steps)
  first_step, step_times = position.step, []
  next_batch = lambda: trainer.put_batch(stream.next_batch(tc.batch_size))  # this process's rows
  batch = next_batch() if position.step < tc.steps else None
  start = time.perf_counter()
  with open(metrics_path, "a") if primary else contextlib.nullcontext() as log:
    for step in bar:
      if trainer.compiled is None:
        trainer.compile(lora, opt_state, frozen, batch)
        start = time.perf_counter()
      lora, opt_state, metrics = trainer.step(lora, opt_state, frozen, batch, step)
      # While the device runs the step: the stream's position after it, the next batch.
      data_after_step = stream_snapshot(stream)
      batch = next_batch() if step + 1 < tc.steps else None
      metrics = jax.device_get(metrics)
      now = time.perf_counter()
      seconds, start = now - start, now  # step to step: the loop's own time counts
      balance = balancer.observe(metrics.pop("expert_load"))
      lora, opt_state, frozen, changes = balancer.after_step(step + 1, lora, opt_state, frozen)
      skipped = bool(metrics["skipped"] > 0)
      position.step = step + 1
      position.nonfinite_total += skipped
      position.nonfinite_in_a_row = position.nonfinite_in_a_row + 1 if skipped else 0
      record = {
          "step": step,
          **{
              k: float(v) for k, v in metrics.items()
          },
          **balance,
          **changes, "nonfinite_total": position.nonfinite_total,
          "step_seconds": seconds,
          "tokens_per_s": float(metrics["tokens"]) / seconds
      }
      if primary:
        log.write(json.dumps(record) + "\n")
        log.flush()
      step_times.append(seconds)
      halted = position.nonfinite_in_a_row >= tc.max_nonfinite_in_a_row
      if halted or ckpt.due(position.step, tc.steps):
        position.data = data_state(stream, data_after_step)
        position.balance = balancer.state(frozen)
        ckpt.save(position, cfg, lora, opt_state)
      if halted:
        ckpt.close()
        raise TrainingHalted(
            f"{position.nonfinite_in_a_row} non-finite steps in a row (steps "
            f"{step + 1 - position.nonfinite_in_a_row}..{step}; train.max_nonfinite_in_a_row="
            f"{tc.max_nonfinite_in_a_row}): their updates were skipped and the last good state "
            f"is saved as checkpoint {ckpt.directory / str(position.step)}")
      bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
  ckpt.close()
  if export_adapter is not None:
    peft_export.export(export_adapter, cfg, frozen, lora, merge=merge)
  return _summary(cfg, mesh, trainer, out, metrics_path, first_step, step_times, stream, primary)


def _summary(cfg, mesh, trainer, out, metrics_path, first_step, step_times, stream, primary):
  tc = cfg.train
  rows = ([json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
          if primary else [])
  losses = [r["loss"] for r in rows] or [math.nan]
  steady = step_times[1:] or step_times or [math.nan]
  summary = {
      "preset": cfg.preset,
      "devices": mesh.size,
      "mesh": dict(mesh.shape),
      "steps": tc.steps,
      "resumed_from": first_step,
      "processes": jax.process_count(),
      "first_loss": losses[0],
      "final_loss": losses[-1],
      "skipped_steps": int(sum(r.get("skipped", 0) for r in rows)),
      "compile_seconds": trainer.compile_seconds,
      "program_fingerprint": trainer.program_fingerprint,
      "remat": trainer.cfg.memory.remat,
      "dispatch": trainer.cfg.model.moe.dispatch,
      "steps_per_s": 1.0 / float(np.mean(steady)),
      "tokens_per_s": tc.batch_size * tc.seq_len / float(np.mean(steady)),
      "out": str(out),
  }
  summary["data"] = stream.summary()  # where the data stands (conversations: truncated, skipped)
  if primary:
    plot_loss(metrics_path, out / "loss.png")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary

"""A training run: the loop with a live progress bar, `metrics.jsonl`, the resolved
config, a loss plot, and a final summary."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from hylora.config import Config
from hylora.overrides import to_dict
from hylora.data import ConversationLoader, is_conversation_file
from hylora.train.data import Packer, make_source
from hylora.train.trainer import Trainer
from meshes.mesh import build_mesh


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


def data_stream(cfg: Config):
  """Conversation / plain-text JSONL through hylora.data (this host's share of every
  batch); token files and the synthetic source through the Packer."""
  tc = cfg.train
  if is_conversation_file(tc.data):
    return ConversationLoader(tc.data, cfg, process_index=jax.process_index(),
                              process_count=jax.process_count())
  return Packer(make_source(tc.data, cfg.model.vocab_size, tc.seed, tc.synthetic_docs),
                tc.seq_len)


def train(cfg: Config, out_dir: str | Path, *, progress: bool = True) -> dict:
  cfg = cfg.validate()
  out = Path(out_dir)
  write_config(cfg, out)
  mesh = build_mesh(cfg.mesh)
  tc = cfg.train
  packer = data_stream(cfg)  # before the model: bad data fails fast
  trainer = Trainer(cfg, mesh)
  lora, opt_state, frozen = trainer.init()

  metrics_path = out / "metrics.jsonl"
  metrics_path.write_text("")
  bar = tqdm(range(tc.steps), desc=f"{cfg.preset} on {mesh.size} devices", disable=not progress,
             dynamic_ncols=True)
  losses, step_times = [], []
  with open(metrics_path, "a") as log:
    for step in bar:
      batch = trainer.put_batch(packer.next_batch(tc.batch_size))
      if trainer.compiled is None:
        trainer.compile(lora, opt_state, frozen, batch)
      start = time.perf_counter()
      lora, opt_state, metrics = trainer.step(lora, opt_state, frozen, batch, step)
      metrics = jax.device_get(metrics)
      seconds = time.perf_counter() - start
      record = {"step": step, **{k: float(v) for k, v in metrics.items()},
                "step_seconds": seconds, "tokens_per_s": float(metrics["tokens"]) / seconds}
      log.write(json.dumps(record) + "\n")
      log.flush()
      losses.append(record["loss"])
      step_times.append(seconds)
      if not math.isfinite(record["loss"]):
        raise FloatingPointError(f"non-finite loss {record['loss']} at step {step}")
      bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
  plot_loss(metrics_path, out / "loss.png")
  steady = step_times[1:] or step_times
  summary = {
      "preset": cfg.preset, "devices": mesh.size, "mesh": dict(mesh.shape), "steps": tc.steps,
      "first_loss": losses[0], "final_loss": losses[-1],
      "compile_seconds": trainer.compile_seconds,
      "steps_per_s": 1.0 / float(np.mean(steady)),
      "tokens_per_s": tc.batch_size * tc.seq_len / float(np.mean(steady)),
      "out": str(out),
  }
  if isinstance(packer, ConversationLoader):
    summary["data"] = packer.state()  # position, truncated and skipped examples
  (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary

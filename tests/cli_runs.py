"""Runs of the main command in subprocesses, shared by the training, checkpoint and
multi-host tests: one tiny configuration, one persistent compilation cache, one reference
run."""

from __future__ import annotations

import atexit
import fcntl
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# two_layer_config() (tests/helpers.py) with a learning rate at which a short run visibly
# lowers the loss: test_train checks that on the reference run.
TINY = [
    "--model.layers=2", "--model.pattern=linear,sparse", "--model.dense_layers=1",
    "--model.moe.dispatch=dropless", "--train.seq_len=64", "--train.batch_size=8",
    "--train.learning_rate=2e-2", "--train.warmup_steps=2", "--quiet"
]
# The 2p8t preset scaled down (every width and count, 4 layers) with everything else its
# own: the L L L S pattern, two dense layers, top-k sigmoid routing over many experts with
# a shared expert, the vision tower, rank-16 adapters, and the default plan.
SCALED_2P8T = [
    "--preset", "2p8t", "--model.vocab_size=512", "--model.d_model=64", "--model.layers=4",
    "--model.dense_ffn=128", "--model.linear_attention.heads=2",
    "--model.linear_attention.head_dim=32", "--model.linear_attention.gate_rank=16",
    "--model.linear_attention.output_gate_rank=16", "--model.sparse_attention.q_heads=4",
    "--model.sparse_attention.kv_heads=2", "--model.sparse_attention.head_dim=16",
    "--model.sparse_attention.top_k=32", "--model.sparse_attention.index_heads=2",
    "--model.sparse_attention.index_head_dim=16", "--model.sparse_attention.index_q_rank=16",
    "--model.sparse_attention.block_q=64", "--model.moe.experts=32", "--model.moe.top_k=4",
    "--model.moe.expert_ffn=32", "--model.vision.image_size=28", "--model.vision.width=32",
    "--model.vision.layers=1", "--model.vision.heads=2", "--model.vision.mlp=64",
    "--model.vision.max_tiles=2", "--model.vision.max_image_side=256", "--train.seq_len=128",
    "--train.batch_size=8", "--train.learning_rate=2e-3", "--train.warmup_steps=1", "--quiet"
]
# Enough steps after the first checkpoint (and after the third step) that the kill -9 of
# the checkpoint and multi-host tests lands while the run is still training.
STEPS = 16
EVERY = 4
# the test session's scratch folder (conftest.py makes it, shared by the -n workers, and
# removes it at the end); a folder of its own when imported outside pytest
if "HYLORA_CLI_SCRATCH" in os.environ:
  _SCRATCH = Path(os.environ["HYLORA_CLI_SCRATCH"])
else:
  _SCRATCH = Path(tempfile.mkdtemp(prefix="hylora-cli-"))
  atexit.register(shutil.rmtree, _SCRATCH, ignore_errors=True)


def xla_flags_for_children() -> str:
  """The suite's XLA flags (conftest.py) less the device count, which a command or
  notebook kernel sets for itself: XLA:CPU without LLVM optimisation. Compiling takes
  most of these runs (the reference run: 48 s instead of 60 s from a cold cache)."""
  return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                  if not f.startswith("--xla_force_host_platform_device_count"))


def env() -> dict:
  out = dict(os.environ)
  out["XLA_FLAGS"] = xla_flags_for_children()
  out["JAX_COMPILATION_CACHE_DIR"] = str(_SCRATCH / "jit-cache")  # one compile for all runs
  out["PYTHONUNBUFFERED"] = "1"
  return out


def command(*args: str, base: list[str] = TINY) -> list[str]:
  return [sys.executable, "-m", "experiments.lora_2p8t", *base, *args]


def launch(*args: str, log: Path | None = None, base: list[str] = TINY) -> subprocess.Popen:
  sink = open(log, "w") if log else subprocess.DEVNULL
  return subprocess.Popen(command(*args, base=base), cwd=ROOT, env=env(), stdout=sink,
                          stderr=subprocess.STDOUT, start_new_session=True)


def run(*args: str, timeout: float = 900, base: list[str] = TINY) -> subprocess.CompletedProcess:
  return subprocess.run(command(*args, base=base), cwd=ROOT, env=env(), capture_output=True,
                        text=True, timeout=timeout)


def metrics(out: Path) -> list[dict]:
  path = Path(out) / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(condition, proc: subprocess.Popen, timeout: float = 900, what: str = ""):
  start = time.monotonic()
  while not condition():
    if proc.poll() is not None:
      raise AssertionError(f"the run exited ({proc.returncode}) before {what}")
    if time.monotonic() - start > timeout:
      kill(proc)
      raise AssertionError(f"timed out waiting for {what}")
    time.sleep(0.05)


def kill(proc: subprocess.Popen) -> None:
  if proc.poll() is None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def scratch(name: str) -> Path:
  return _SCRATCH / name


@functools.cache
def reference_run() -> Path:
  """STEPS straight steps on one process x 8 devices, a checkpoint every EVERY steps,
  and the adapter exported at the end."""
  out = scratch("reference")
  with open(scratch("reference.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be running it: wait, then reuse
    if not (out / "summary.json").exists():
      shutil.rmtree(out, ignore_errors=True)
      done = run("--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--out", str(out),
                 "--export-adapter", str(out / "adapter"))
      assert done.returncode == 0, done.stderr[-3000:]
  return out


def comparable(rows: list[dict]) -> list[dict]:
  """Metrics without the wall-clock fields."""
  return [{k: v for k, v in r.items() if k not in ("step_seconds", "tokens_per_s")} for r in rows]

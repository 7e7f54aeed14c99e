"""Checkpoints: save / keep-last-K / restore, refusal of mismatched or corrupted ones, a
kill -9 during an asynchronous save, exact resume of a killed run, and the stop after
too many non-finite steps."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors import safe_open

import cli_runs
from helpers import small_config, two_layer_config
from hylora.io import hf_weights
from hylora.io.checkpoint import Checkpoints, Position, trim_metrics
from hylora.core.errors import CheckpointError
from weights_helpers import model_and_trees


def _trees(offset: float = 0.0):
  mesh = jax.make_mesh((8,), ("x",))
  sharding = NamedSharding(mesh, P("x"))
  lora = {
      "q": {
          "lora_a": jax.device_put(
              np.arange(64, dtype=np.float32).reshape(8, 8) + offset, sharding)
      },
      "b": jax.device_put(np.full((16,), offset, np.float32), sharding)
  }
  return lora, jax.jit(optax.adamw(1e-3).init)(lora)


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


@pytest.fixture
def saved(tmp_path):
  cfg = small_config()
  ck = Checkpoints(tmp_path, every=2, keep=2)
  for step in (2, 4, 6):
    lora, opt = _trees(step)
    ck.save(Position(step, {"packer": [step, 1]}, 1, 0), cfg, lora, opt)
  ck.wait()
  yield cfg, ck, tmp_path
  ck.close()


def test_keeps_last_k_and_restores_exactly(saved):
  cfg, ck, _ = saved
  assert ck.steps() == [4, 6] and ck.latest() == 6
  assert ck.due(4, 10) and ck.due(10, 10) and not ck.due(5, 10)
  lora, opt = _trees(6)
  reopened = Checkpoints(saved[2])
  got_lora, got_opt, position = reopened.restore(6, cfg, _abstract(lora), _abstract(opt))
  reopened.close()
  assert position == Position(6, {"packer": [6, 1]}, 1, 0)
  for a, b in zip(jax.tree.leaves((lora, opt)), jax.tree.leaves((got_lora, got_opt))):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_refuses_other_config_and_shapes(saved):
  cfg, ck, _ = saved
  lora, opt = _trees()
  other = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=8))
  with pytest.raises(CheckpointError, match=r"different configuration: lora.rank=4 there, 8 now"):
    ck.restore(6, other, _abstract(lora), _abstract(opt))
  longer = dict(_abstract(lora), b=jax.ShapeDtypeStruct((32,), np.float32,
                                                        sharding=lora["b"].sharding))
  with pytest.raises(CheckpointError, match=r"lora/b is float32\[16\] there, this model needs "
                     r"float32\[32\]"):
    ck.restore(6, cfg, longer, _abstract(opt))
  # steps and checkpoint settings may change on resume
  steps = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=99))
  ck.restore(6, steps, _abstract(lora), _abstract(opt))


def test_refuses_corrupted_checkpoints(saved):
  cfg, ck, root = saved
  lora, opt = _trees()
  step = root / "checkpoints" / "6"
  for data in (step / "lora").rglob("*"):
    if data.is_file() and data.parent.name == "d":
      data.write_bytes(b"\0garbage")
  with pytest.raises(
      CheckpointError, match=r"checkpoints/6: its array.* unreadable .*delete it "
      r"to resume from step 4"):
    ck.restore(6, cfg, _abstract(lora), _abstract(opt))
  (step / "meta" / "metadata").write_text("{not json")
  with pytest.raises(CheckpointError, match=r"checkpoints/6: its metadata is unreadable"):
    ck.restore(6, cfg, _abstract(lora), _abstract(opt))


def test_trim_metrics_keeps_steps_before_the_checkpoint(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(7)))
  trim_metrics(path, 4)
  assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1, 2, 3]
  trim_metrics(path, 0)
  assert path.read_text() == ""


_KILL_DURING_SAVE = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import jax, numpy as np
    from helpers import small_config
    from hylora.io.checkpoint import Checkpoints, Position
    cfg = small_config()
    ck = Checkpoints({root!r}, every=1, keep=3)
    small = {{"w": jax.numpy.ones((4,))}}
    ck.save(Position(1), cfg, small, small)
    ck.wait()
    big = {{f"w{{i}}": jax.numpy.full((1 << 22,), i, np.float32) for i in range(8)}}
    ck.save(Position(2), cfg, big, big)  # asynchronous: returns while the files are written
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_kill_during_async_save_keeps_the_previous_checkpoint(tmp_path):
  script = _KILL_DURING_SAVE.format(tests=str(Path(__file__).parent), root=str(tmp_path))
  done = subprocess.run([sys.executable, "-c", script], env=cli_runs.env(), capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == -9, done.stderr[-2000:]
  leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir()]
  assert any(name.startswith("2.") for name in leftovers), leftovers  # the unfinished save
  ck = Checkpoints(tmp_path)
  assert ck.steps() == [1]
  small = {"w": jax.numpy.ones((4,))}
  lora, opt, position = ck.restore(1, small_config(), _abstract(small), _abstract(small))
  assert position.step == 1 and np.asarray(lora["w"]).tolist() == [1.0] * 4
  ck.save(Position(2), small_config(), small, small)  # the next save goes through
  ck.close()
  assert Checkpoints(tmp_path).steps() == [1, 2]


def _adapter(path: Path) -> dict:
  with safe_open(str(path / "adapter_model.safetensors"), framework="numpy") as f:
    return {k: f.get_tensor(k) for k in f.keys()}


def test_resume_after_kill_is_exact():
  steps, every = cli_runs.STEPS, cli_runs.EVERY
  reference = cli_runs.reference_run()
  out = cli_runs.scratch("killed")
  args = ("--steps", str(steps), "--checkpoint-every", str(every), "--out", str(out),
          "--export-adapter", str(out / "adapter"))
  proc = cli_runs.launch(*args, log=cli_runs.scratch("killed.log"))
  cli_runs.wait_for(
      lambda: len(cli_runs.metrics(out)) > every and (out / "checkpoints" / str(every)).is_dir(),
      proc, what=f"step {every} and its checkpoint")
  cli_runs.kill(proc)
  assert proc.returncode == -9
  assert len(cli_runs.metrics(out)) < steps and not (out / "summary.json").exists()

  done = cli_runs.run(*args, "--resume")
  assert done.returncode == 0, done.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  assert 0 < summary["resumed_from"] < steps
  # the same metrics (losses bit for bit), one record per step, and the same adapters
  assert cli_runs.comparable(cli_runs.metrics(out)) == cli_runs.comparable(
      cli_runs.metrics(reference))
  want, got = _adapter(reference / "adapter"), _adapter(out / "adapter")
  assert set(want) == set(got)
  for name in want:
    np.testing.assert_array_equal(want[name], got[name], err_msg=name)


def test_resume_refuses_a_different_config_and_fresh_runs_refuse_old_checkpoints(capsys):
  # The command's main() in this process (the same 8 devices): both refusals come before
  # any model is built; the runs above cover the command as a process.
  from experiments.lora_2p8t import main
  reference = cli_runs.reference_run()
  args = [*cli_runs.TINY, "--steps", str(cli_runs.STEPS), "--out", str(reference)]
  assert main([*args, "--resume", "--lora.rank=8"]) == 2
  err = capsys.readouterr().err
  assert err.strip().startswith("error: checkpoint ")
  assert "lora.rank=4 there, 8 now" in err and "Traceback" not in err
  assert main(args) == 2 and "pass --resume" in capsys.readouterr().err


def test_nonfinite_steps_are_skipped_then_stop_the_run(tmp_path):
  cfg = two_layer_config()  # the model of cli_runs.TINY
  _, _, _, frozen = model_and_trees(cfg)
  head = np.asarray(frozen["lm_head"]).copy()
  head[0, 0] = np.nan  # every step's loss is NaN
  frozen["lm_head"] = jax.device_put(head, frozen["lm_head"].sharding)
  hf_weights.save(tmp_path / "base", cfg, frozen)
  out = tmp_path / "run"
  done = cli_runs.run("--steps", str(cli_runs.STEPS), "--checkpoint-every",
                      str(cli_runs.EVERY), "--base-weights", str(tmp_path / "base"), "--out",
                      str(out), "--train.max_nonfinite_in_a_row=2")
  assert done.returncode == 1, done.stderr[-3000:]
  assert "error: 2 non-finite steps in a row" in done.stderr
  assert "checkpoints/2" in done.stderr
  rows = cli_runs.metrics(out)
  assert [(r["step"], r["skipped"], r["nonfinite_total"]) for r in rows] == [(0, 1, 1), (1, 1, 2)]
  assert Checkpoints(out).steps() == [2]
  restored = Checkpoints(out).manager.restore(
      2, args=ocp.args.Composite(lora=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
  assert restored["meta"]["nonfinite_in_a_row"] == 2
  b_factors = [
      np.asarray(x)
      for p, x in jax.tree_util.tree_flatten_with_path(restored["lora"])[0]
      if "lora_b" in jax.tree_util.keystr(p)
  ]
  assert b_factors and all((b == 0).all() for b in b_factors)  # never updated: B starts at 0
  assert not os.path.exists(out / "summary.json")

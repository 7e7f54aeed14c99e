"""The sharded train step: the same numbers on a 2 x 4 mesh as on one device, exact
gradient accumulation, only adapters update, and the loss falls."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cli_runs
from hylora.core.config import MeshConfig
from hylora.model import IGNORE_INDEX
from hylora.train import state as st
from hylora.data.sources import Packer, SyntheticSource
from hylora.train.step import make_loss_fn
from hylora.train.trainer import Trainer
from meshes.mesh import build_mesh
from meshes.rules import activation_mesh
from helpers import two_layer_config

# XLA:CPU's LLVM passes dominate the compile; the numbers do not depend on them.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _fp32(cfg, **train):
  """fp32 base weights: partitioned reductions then agree to float32 rounding."""
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, weight_dtype="float32"),
                             train=dataclasses.replace(cfg.train, **train))


@pytest.fixture(scope="module")
def setup():
  # One layer of each kind: the shardings and reductions do not depend on depth.
  cfg = _fp32(two_layer_config(), grad_accum=2)
  parts = st.model_parts(cfg)
  batch = Packer(SyntheticSource(cfg.model.vocab_size, seed=1), cfg.train.seq_len).next_batch(8)
  mesh = build_mesh(cfg.mesh)
  lora, frozen = st.init_params(cfg, parts, mesh)  # built once, moved to the other mesh
  return cfg, parts, batch, mesh, (lora, frozen)


def _grads(cfg, parts, batch, mesh, params):
  lora, frozen = jax.device_put(params, st.shardings(parts, mesh))
  objective = make_loss_fn(
      dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum=1)), parts)
  total = int(np.sum(batch["labels"] != IGNORE_INDEX))

  @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
  def fn(lora, frozen, batch):
    with activation_mesh(mesh):
      return jax.value_and_grad(objective, has_aux=True)(lora, frozen, batch, total, None)

  (_, info), grads = fn(lora, frozen, {k: jnp.asarray(v) for k, v in batch.items()})
  return float(info["loss_sum"]) / total, jax.device_get(grads), jax.device_get(lora)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.fixture(scope="module")
def sharded_grads(setup):
  cfg, parts, batch, mesh, params = setup
  return _grads(cfg, parts, batch, mesh, params)


def test_sharded_gradients_match_one_device(setup, sharded_grads):
  cfg, parts, batch, _, params = setup
  one = build_mesh(MeshConfig(fsdp=1, expert=1), jax.devices()[:1])
  loss1, g1, _ = _grads(cfg, parts, batch, one, params)
  loss8, g8, _ = sharded_grads
  assert abs(loss1 - loss8) < 1e-6 * abs(loss1)
  leaves1, leaves8 = jax.tree.leaves(g1), jax.tree.leaves(g8)
  assert len(leaves1) == len(leaves8) > 0
  for a, b in zip(leaves8, leaves1):
    assert _rel(a, b) < 1e-5


def test_accumulated_step_updates_only_adapters_exactly(setup, sharded_grads):
  cfg, _, batch, mesh, (lora, frozen) = setup
  loss8, grads, lora0 = sharded_grads
  trainer = Trainer(cfg, mesh)  # grad_accum=2
  # The step donates it; the fixture keeps its own (one compiled copy, not one per leaf).
  lora = jax.jit(lambda t: jax.tree.map(jnp.copy, t),
                 out_shardings=jax.tree.map(lambda a: a.sharding, lora))(lora)
  opt = trainer.init_optimizer(lora)  # the rest of trainer.init(): same seed, same arrays
  frozen_before = jax.device_get(frozen)
  lora, opt, metrics = trainer.step(lora, opt, frozen, trainer.put_batch(batch), 0)
  metrics = jax.device_get(metrics)
  # One Adam step from fresh moments on the whole batch's gradient, compiled as one
  # program (op by op it compiled each optimizer op per leaf shape).
  @jax.jit
  def one_step(grads, lora0):
    updates, _ = trainer.optimizer.update(grads, trainer.optimizer.init(lora0), lora0)
    return optax.apply_updates(lora0, updates), optax.global_norm(grads)

  expected, grad_norm = one_step(grads, lora0)
  # Two accumulated micro-batches give the whole batch's loss and gradient.
  assert abs(metrics["loss"] - loss8) < 1e-6 * loss8
  assert abs(metrics["grad_norm"] - grad_norm) < 1e-5 * metrics["grad_norm"]
  for a, b in zip(jax.tree.leaves(jax.device_get(lora)), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  # The frozen base is untouched and the optimizer holds nothing of its shape.
  for a, b in zip(jax.tree.leaves(jax.device_get(frozen)), jax.tree.leaves(frozen_before)):
    np.testing.assert_array_equal(a, b)
  opt_shapes = {tuple(x.shape) for x in jax.tree.leaves(opt) if x.ndim}
  assert opt_shapes == {tuple(x.shape) for x in jax.tree.leaves(lora0)}


def test_tiny_training_loss_falls_and_writes_outputs():
  # The command's reference run (tests/cli_runs.py) is `train()` on two_layer_config()
  # with learning_rate=2e-2, warmup_steps=2; the checkpoint and multi-host tests compare
  # against the same run, so it is compiled and trained once.
  out = cli_runs.reference_run()
  rows = cli_runs.metrics(out)
  assert [r["step"] for r in rows] == list(range(cli_runs.STEPS))
  assert all({"loss", "tokens_per_s", "grad_norm", "learning_rate"} <= r.keys() for r in rows)
  first, last = np.mean([r["loss"] for r in rows[:3]]), np.mean([r["loss"] for r in rows[-3:]])
  assert last < first - 0.3, (first, last)
  assert (out / "loss.png").stat().st_size > 1000
  assert json.loads((out / "config.json").read_text())["model"]["layers"] == 2
  assert json.loads((out / "summary.json").read_text())["final_loss"] == rows[-1]["loss"]

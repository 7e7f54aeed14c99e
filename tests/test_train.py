"""The sharded train step: the same numbers on a 2 x 4 mesh as on one device, exact
gradient accumulation, only adapters update, and the loss falls."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hylora.config import MeshConfig
from hylora.model import IGNORE_INDEX
from hylora.train import state as st
from hylora.train.data import Packer, SyntheticSource
from hylora.train.run import train
from hylora.train.step import make_loss_fn
from hylora.train.trainer import Trainer
from meshes.mesh import build_mesh
from meshes.rules import activation_mesh
from tests.helpers import small_config


def _fp32(cfg, **train):
  """fp32 base weights: partitioned reductions then agree to float32 rounding."""
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, weight_dtype="float32"),
                             train=dataclasses.replace(cfg.train, **train))


@pytest.fixture(scope="module")
def setup():
  cfg = _fp32(small_config(), grad_accum=2)
  parts = st.model_parts(cfg)
  batch = Packer(SyntheticSource(cfg.model.vocab_size, seed=1), cfg.train.seq_len).next_batch(8)
  return cfg, parts, batch


def _grads(cfg, parts, batch, mesh):
  lora, frozen = st.init_params(cfg, parts, mesh)
  objective = make_loss_fn(dataclasses.replace(cfg, train=dataclasses.replace(
      cfg.train, grad_accum=1)), parts)
  total = int(np.sum(batch["labels"] != IGNORE_INDEX))

  @jax.jit
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
  cfg, parts, batch = setup
  return _grads(cfg, parts, batch, build_mesh(cfg.mesh))


def test_sharded_gradients_match_one_device(setup, sharded_grads):
  cfg, parts, batch = setup
  one = build_mesh(MeshConfig(fsdp=1, expert=1), jax.devices()[:1])
  loss1, g1, _ = _grads(cfg, parts, batch, one)
  loss8, g8, _ = sharded_grads
  assert abs(loss1 - loss8) < 1e-6 * abs(loss1)
  leaves1, leaves8 = jax.tree.leaves(g1), jax.tree.leaves(g8)
  assert len(leaves1) == len(leaves8) > 0
  for a, b in zip(leaves8, leaves1):
    assert _rel(a, b) < 1e-5


def test_accumulated_step_updates_only_adapters_exactly(setup, sharded_grads):
  cfg, _, batch = setup
  loss8, grads, lora0 = sharded_grads
  trainer = Trainer(cfg, build_mesh(cfg.mesh))  # grad_accum=2
  lora, opt, frozen = trainer.init()
  frozen_before = jax.device_get(frozen)
  lora, opt, metrics = trainer.step(lora, opt, frozen, trainer.put_batch(batch), 0)
  metrics = jax.device_get(metrics)
  # Two accumulated micro-batches give the whole batch's loss and gradient.
  assert abs(metrics["loss"] - loss8) < 1e-6 * loss8
  assert abs(metrics["grad_norm"] - optax.global_norm(grads)) < 1e-5 * metrics["grad_norm"]
  expected_updates, _ = trainer.optimizer.update(grads, trainer.optimizer.init(lora0), lora0)
  expected = optax.apply_updates(lora0, expected_updates)
  for a, b in zip(jax.tree.leaves(jax.device_get(lora)), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  # The frozen base is untouched and the optimizer holds nothing of its shape.
  for a, b in zip(jax.tree.leaves(jax.device_get(frozen)), jax.tree.leaves(frozen_before)):
    np.testing.assert_array_equal(a, b)
  opt_shapes = {tuple(x.shape) for x in jax.tree.leaves(opt) if x.ndim}
  assert opt_shapes == {tuple(x.shape) for x in jax.tree.leaves(lora0)}


def test_tiny_training_loss_falls_and_writes_outputs(tmp_path):
  cfg = small_config(steps=8, learning_rate=2e-2, warmup_steps=2)
  summary = train(cfg, tmp_path, progress=False)
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(8))
  assert all({"loss", "tokens_per_s", "grad_norm", "learning_rate"} <= r.keys() for r in rows)
  first, last = np.mean([r["loss"] for r in rows[:3]]), np.mean([r["loss"] for r in rows[-3:]])
  assert last < first - 0.3, (first, last)
  assert (tmp_path / "loss.png").stat().st_size > 1000
  assert json.loads((tmp_path / "config.json").read_text())["model"]["layers"] == 4
  assert summary["final_loss"] == rows[-1]["loss"]

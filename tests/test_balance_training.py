"""Balancing wired into training: on the 2 x 4 mesh with a deliberately skewed router
and spare slots, a re-placement moves base weights, LoRA factors and Adam moments
without changing the loss or the (logical) LoRA gradients, replicas stay tied through
optimizer steps, and the aux-loss-free bias update evens the load."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hylora.io import hf_weights
from hylora.io import peft_export
from hylora.core.config import MeshConfig
from hylora.core.errors import ConfigError
from hylora.model import IGNORE_INDEX
from hylora.model.ffn import placement as pl
from hylora.model.ffn.router import Router
from hylora.model.init import ParamInit
from hylora.core.presets import tiny
from hylora.train import expert_sites
from hylora.train import state as st
from hylora.train.balancer import ExpertBalancer, rank_load_ratio
from hylora.data.sources import Packer, SyntheticSource
from hylora.train.step import make_loss_fn
from hylora.train.trainer import Trainer, check_model_fits_mesh
from meshes.mesh import build_mesh
from meshes.rules import activation_mesh

E = 8


def _config(**moe):
  """The tiny preset cut to one MoE layer, fp32 weights, 4 spare slots (3 per EP rank)."""
  cfg = tiny()
  moe = dataclasses.replace(cfg.model.moe, dispatch="ep_alltoall", spare_slots=4, **moe)
  model = dataclasses.replace(cfg.model, layers=1, dense_layers=0, pattern=("linear",), moe=moe,
                              weight_dtype="float32",
                              vision=dataclasses.replace(cfg.model.vision, enabled=False))
  return dataclasses.replace(
      cfg, model=model, mesh=MeshConfig(fsdp=2, expert=4),
      memory=dataclasses.replace(cfg.memory, remat="none"),
      train=dataclasses.replace(cfg.train, seq_len=64, batch_size=8, warmup_steps=0)).validate()


def _set(tree, path, value):
  for key in path[:-1]:
    tree = tree[key]
  old = tree[path[-1]]
  tree[path[-1]] = jax.device_put(jnp.asarray(value, old.dtype), old.sharding)


def _copy(tree):
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


@pytest.fixture(scope="module")
def run():
  cfg = _config()
  mesh = build_mesh(cfg.mesh)
  trainer = Trainer(cfg, mesh)
  lora, opt, frozen = trainer.init()
  (site,) = expert_sites.find_sites(cfg, frozen)
  table = np.asarray(pl.initial_placement(E, E + 4))
  # Skew the router (experts 0 and 3 hot) and give B values (tied over the initial copies).
  router = frozen
  for key in site.path + ("router",):
    router = router[key]
  _set(frozen, site.path + ("router", "kernel"), router["kernel"] * 4)
  _set(frozen, site.path + ("router", "bias"), [[0.3, 0, 0, 0.2, 0, 0, 0, 0]])
  b = ParamInit(1).normal((1, E, cfg.lora.rank, 2 * cfg.model.moe.expert_ffn), 0.5)
  _set(lora, site.path + ("experts", "lora_b"), b[:, table])
  packer = Packer(SyntheticSource(cfg.model.vocab_size, seed=1), cfg.train.seq_len)
  batches = [trainer.put_batch(packer.next_batch(8)) for _ in range(2)]
  objective = make_loss_fn(cfg, trainer.parts)

  @jax.jit
  def grads(lora, frozen, batch):
    total = jnp.sum(batch["labels"] != IGNORE_INDEX)
    with activation_mesh(mesh):
      return jax.value_and_grad(objective, has_aux=True)(lora, frozen, batch, total, None)

  return cfg, mesh, trainer, site, (lora, opt, frozen), batches, grads


def _experts(tree, site):
  node = tree
  for key in site.path + ("experts",):
    node = node[key]
  return node


def test_replacement_keeps_loss_and_logical_lora_gradients(run):
  cfg, mesh, _, site, (lora, opt, frozen), batches, grads = run
  (loss0, info0), g0 = grads(lora, frozen, batches[0])
  load = np.asarray(info0["expert_load"])
  balancer = ExpertBalancer(cfg, mesh, frozen)
  balancer.observe(load)
  old = balancer.tables[site.path]
  new = balancer.plan(balancer.placement_window)[site.path]
  before, after = rank_load_ratio(np.concatenate([load, load]), np.stack([old[0], new[0]]), 4)
  assert before > 1.3 and after < before - 0.2  # the skew is real and re-placement helps
  assert np.bincount(new[0], minlength=E).max() >= 2  # hot experts got the spare slots
  lora1, opt1, frozen1 = balancer.apply(*_copy((lora, opt, frozen)), {site.path: new})
  assert np.array_equal(balancer.tables[site.path], new)
  (loss1, info1), g1 = grads(lora1, frozen1, batches[0])
  np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
  np.testing.assert_array_equal(info1["expert_load"], info0["expert_load"])
  e0, e1 = _experts(g0, site), _experts(g1, site)
  for name in ("lora_a", "lora_b"):  # per expert: the sum over its copies
    logical = lambda g, t: jax.vmap(lambda a, t: pl.logical_rows(a, t, E))(g, jnp.asarray(t))
    np.testing.assert_allclose(logical(e1[name], new), logical(e0[name], old), rtol=1e-4, atol=1e-7)
  for path, a in jax.tree_util.tree_flatten_with_path(g0)[0]:
    if "experts" not in jax.tree_util.keystr(path):  # shared experts, attention: unchanged
      b = g1
      for k in path:
        b = b[k.key]
      np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7)
  # Tied: each expert's summed gradient sits in its first copy, zeros in the others.
  tied = _experts(expert_sites.tie_replica_grads(g1, {site.path: jnp.asarray(new)}, E), site)
  primary = np.asarray(pl.relocate(jnp.arange(E + 4), new[0], new[0], E))  # first copy per slot
  for name in ("lora_a", "lora_b"):
    total = pl.logical_rows(e1[name][0], jnp.asarray(new[0]), E)
    for s, e in enumerate(new[0]):
      want = total[e] if primary[s] == s else 0 * total[e]
      np.testing.assert_allclose(tied[name][0, s], want, rtol=1e-6, atol=1e-7)


def _first_copy(tree, site, table):
  """Per-slot leaves -> per-expert rows (each expert's first copy)."""
  identity = np.broadcast_to(np.arange(E, dtype=np.int32), (table.shape[0], E))
  return expert_sites.relocate(tree, {site.path: table}, {site.path: identity}, E)


def test_steps_with_a_replacement_between_match_steps_without(run):
  cfg, mesh, trainer, site, start, batches, _ = run
  # A: step, re-place experts (weights, LoRA, Adam moments), step; B: two steps.
  lora, opt, frozen = _copy(start)
  balancer = ExpertBalancer(cfg, mesh, frozen)
  lora, opt, m0 = trainer.step(lora, opt, frozen, batches[0], 0)
  balancer.observe(jax.device_get(m0["expert_load"]))
  lora, opt, frozen, info = balancer.rebalance(lora, opt, frozen)
  assert info["rebalanced_layers"] == 1 and info["rebalance_window_after"] < 1.2
  lora_a, opt_a, m_a = trainer.step(lora, opt, frozen, batches[1], 1)
  table = balancer.tables[site.path]

  lora, opt, frozen_b = _copy(start)
  lora, opt, _ = trainer.step(lora, opt, frozen_b, batches[0], 0)
  lora_b, opt_b, m_b = trainer.step(lora, opt, frozen_b, batches[1], 1)
  initial = np.asarray(pl.initial_placement(E, E + 4))[None]

  np.testing.assert_allclose(m_a["loss"], m_b["loss"], rtol=1e-6)
  np.testing.assert_allclose(m_a["grad_norm"], m_b["grad_norm"], rtol=1e-5)
  # The same adapters and Adam moments per expert; every copy equal to its first.
  for a, b in ((lora_a, lora_b), (opt_a[1][0].mu, opt_b[1][0].mu), (opt_a[1][0].nu,
                                                                    opt_b[1][0].nu)):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-8),
                 _first_copy(a, site, table), _first_copy(b, site, initial))
  ex = _experts(lora_a, site)
  for name in ("lora_a", "lora_b"):
    refreshed = jax.vmap(lambda a, t: pl.refresh_replicas(a, t, E))(ex[name], jnp.asarray(table))
    np.testing.assert_array_equal(refreshed, ex[name])
  assert not np.allclose(ex["lora_b"], _experts(start[0], site)["lora_b"])  # it trained


def test_bias_updates_even_the_load_and_leave_combine_weights_alone(run):
  cfg, mesh, _, site, start, batches, grads = run
  cfg = dataclasses.replace(
      cfg, model=dataclasses.replace(
          cfg.model, moe=dataclasses.replace(cfg.model.moe, bias_update_every=1,
                                             bias_update_rate=0.05)))
  lora, opt, frozen = _copy(start)
  balancer = ExpertBalancer(cfg, mesh, frozen)
  ratios = []
  for step in range(4):
    (_, info), _ = grads(lora, frozen, batches[0])
    load = np.asarray(info["expert_load"])
    ratios.append(float((load.max(-1) / load.mean(-1)).max()))
    balancer.observe(load)
    lora, opt, frozen, out = balancer.after_step(step + 1, lora, opt, frozen)
    assert out == {"router_bias_updated": 1.0}  # rebalance_every=0: no re-placement
  assert ratios[-1] < ratios[0] - 0.3, ratios
  # The bias picks experts; the weights stay the (normalised) router scores.
  node = frozen
  for key in site.path + ("router",):
    node = node[key]
  router = Router(cfg.model.d_model, cfg.model.moe, init_std=0.0, init=ParamInit(0),
                  dtype="float32")
  router.kernel[...] = jnp.asarray(node["kernel"][0])
  router.bias[...] = jnp.asarray(node["bias"][0])
  x = jax.random.normal(jax.random.key(0), (32, cfg.model.d_model))
  weights, experts, _ = router(x)
  scores = jax.nn.softmax(x @ router.kernel[...], axis=-1)
  chosen = jnp.take_along_axis(scores, experts, axis=-1)
  np.testing.assert_allclose(weights, chosen / chosen.sum(-1, keepdims=True), rtol=1e-5)


def test_hf_weights_and_peft_export_are_placement_free(run, tmp_path):
  cfg, mesh, trainer, site, start, _, _ = run
  lora, opt, frozen = _copy(start)
  moved = np.array([[3, 0, 5, 3, 1, 7, 0, 2, 4, 6, 3, 0]], np.int32)  # copies of 0 and 3
  balancer = ExpertBalancer(cfg, mesh, frozen)
  lora1, _, frozen1 = balancer.apply(*_copy((lora, opt, frozen)), {site.path: moved})
  # Written per logical expert (from its first copy): the same tensors as before the move.
  want = dict(hf_weights.model_tensors(cfg, frozen))
  got = dict(hf_weights.model_tensors(cfg, frozen1))
  assert set(got) == set(want) and "model.layers.0.mlp.experts.7.down_proj.weight" in got
  for name in want:
    np.testing.assert_array_equal(got[name], want[name])
  adapters = dict(peft_export.adapter_tensors(cfg, frozen1, lora1))
  for name, value in peft_export.adapter_tensors(cfg, frozen, lora):
    np.testing.assert_array_equal(adapters[name], value)
  # Loading gives the initial placement: slot s holds expert s mod 8.
  hf_weights.save(tmp_path, cfg, frozen1)
  _, abstract = st.abstract_arrays(trainer.parts, mesh)
  loaded, _ = hf_weights.load(tmp_path, cfg, abstract)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), loaded, frozen)


def test_balancer_state_survives_a_checkpoint_round_trip(run):
  cfg, mesh, _, site, start, _, _ = run
  lora, opt, frozen = _copy(start)
  balancer = ExpertBalancer(cfg, mesh, frozen)
  balancer.observe(np.arange(E, dtype=np.float64)[None])
  moved = np.array([[7, 0, 5, 6, 1, 7, 4, 2, 3, 6, 7, 5]], np.int32)
  lora, opt, frozen = balancer.apply(lora, opt, frozen, {site.path: moved})
  frozen = balancer.update_bias(frozen)
  state = json.loads(json.dumps(balancer.state(frozen)))  # as the checkpoint stores it
  fresh = ExpertBalancer(cfg, mesh, _copy(start)[2])
  restored = fresh.restore(state, _copy(start)[2])
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), restored, frozen)
  assert np.array_equal(fresh.tables[site.path], moved)
  np.testing.assert_array_equal(fresh.placement_window, balancer.placement_window)


def test_slots_must_split_over_the_expert_ranks():
  cfg = _config()
  cfg = dataclasses.replace(
      cfg, model=dataclasses.replace(cfg.model,
                                     moe=dataclasses.replace(cfg.model.moe, spare_slots=3)))
  with pytest.raises(ConfigError, match="model.moe.spare_slots: 8 experts \\+ 3 spare slots"):
    check_model_fits_mesh(cfg, build_mesh(cfg.mesh))

"""Load metrics, the expert-placement planner, relocation of weights / LoRA factors /
optimizer moments, the aux-loss-free bias step and the sequence-level balance loss."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hylora.core.config import MeshConfig
from hylora.model.context import ForwardContext
from hylora.model.ffn import balance
from hylora.model.ffn.moe import MoE
from hylora.model.ffn.placement import logical_rows, relocate_module, route_to_slots
from hylora.model.ffn.router import sequence_balance_loss
from hylora.model.init import ParamInit
from hylora.model.lora import LoRAParam
from meshes.mesh import build_mesh
from meshes.rules import activation_mesh
from tests.helpers import small_config


def test_metrics_on_a_hand_built_routing():
  # 6 tokens, top-2, 8 experts on 4 ranks (2 slots each).
  experts = np.array([[0, 1], [0, 4], [0, 5], [1, 4], [0, 6], [5, 7]])
  load = jnp.bincount(jnp.asarray(experts).reshape(-1), length=8).astype(jnp.float32)
  np.testing.assert_array_equal(load, [4, 2, 0, 0, 2, 2, 1, 1])
  m = balance.load_metrics(load, jnp.arange(8), ranks=4)
  np.testing.assert_array_equal(m["rank_load"], [6, 0, 4, 2])
  np.testing.assert_allclose(m["rank_max_over_mean"], 6 / 3)
  np.testing.assert_allclose(m["expert_max_over_mean"], 4 / 1.5)
  # 12 slots, 3 per rank; experts 0, 4, 5, 6 in two slots, each copy carrying half.
  table = jnp.array([0, 1, 0, 2, 3, 4, 5, 6, 7, 4, 5, 6])
  np.testing.assert_array_equal(balance.rank_loads(load, table, 4),
                                [2 + 2 + 2, 0 + 0 + 1, 1 + 0.5 + 1, 1 + 1 + 0.5])


def test_planner_replicates_the_hottest_and_balances_the_ranks():
  load = np.array([40, 30, 8, 6, 6, 4, 3, 3], np.float64)
  identity = np.arange(8)
  table = balance.plan_placement(np.stack([load / 2, load / 2]), ranks=4, slots_per_rank=3)
  assert table.shape == (12,) and set(table) == set(range(8))
  copies = np.bincount(table, minlength=8)
  assert copies[0] >= 2 and copies[1] >= 2  # the hot experts got the spare slots
  for r in range(4):  # no rank holds two copies of one expert
    assert len(set(table[3 * r:3 * r + 3])) == 3
  before = float(balance.busiest_over_mean(balance.rank_loads(load, identity, 4)))
  after = float(balance.busiest_over_mean(balance.rank_loads(load, table, 4)))
  assert np.isclose(before, 70 / 25) and after < 1.25
  # Without spare slots it is a permutation that still lowers the busiest rank.
  perm = balance.plan_placement(load, ranks=4, slots_per_rank=2)
  assert sorted(perm) == list(range(8))
  assert float(balance.busiest_over_mean(balance.rank_loads(load, perm, 4))) < before


def test_route_to_slots_spreads_a_replicated_expert_over_its_copies():
  table = jnp.array([2, 0, 1, 0])  # expert 0 in slots 1 and 3
  experts = jnp.array([[0, 2], [0, 1], [0, 2], [1, 0]])
  np.testing.assert_array_equal(route_to_slots(experts, table, 3), [[1, 0], [3, 2], [1, 0], [2, 3]])


def _skewed_layer(cfg):
  layer = MoE(cfg.model, cfg.lora, init=ParamInit(0))
  init = ParamInit(1)
  for b in (layer.experts.lora_b, layer.shared.gate_up.lora_b):
    b[...] = init.normal(b.shape, 0.5)
  # Sharper, skewed routing: experts 0 and 3 are chosen far more often.
  layer.router.kernel[...] = (layer.router.kernel[...].astype(jnp.float32) * 4).astype(jnp.bfloat16)
  layer.router.bias[...] = jnp.array([0.3, 0, 0, 0.2, 0, 0, 0, 0], jnp.float32)
  return layer


def test_replacement_leaves_outputs_and_gradients_unchanged_and_lowers_the_busiest_rank():
  cfg = small_config()
  cfg = dataclasses.replace(
      cfg, model=dataclasses.replace(cfg.model,
                                     moe=dataclasses.replace(cfg.model.moe,
                                                             dispatch="ep_alltoall")))
  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  # Built under jit: one compile instead of hundreds of eager initialisers.
  graphdef, lora, rest = nnx.split(nnx.jit(lambda: _skewed_layer(cfg))(), LoRAParam, ...)
  b, t, d = 4, 16, cfg.model.d_model
  ctx = ForwardContext(jnp.ones((b, t), jnp.int32), jnp.zeros((b, t), jnp.int32))
  x = jax.random.normal(jax.random.key(0), (b, t, d))
  probe = jax.random.normal(jax.random.key(1), x.shape)

  @jax.jit
  def run(lora, rest, x):

    def loss(lora, x):
      y, aux = nnx.merge(graphdef, lora, rest)(x, ctx)
      return jnp.sum(y * probe), (y, aux["expert_load"])

    with activation_mesh(mesh):
      return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(lora, x)

  relocate = jax.jit(lambda tree, table: relocate_module(tree, table, 8, jnp.arange(8)))

  def placed(table):
    lora_p, rest_p = jax.tree.map(lambda v: v, (lora, rest))
    nnx.replace_by_pure_dict(lora_p, relocate(nnx.to_pure_dict(lora), table))
    nnx.replace_by_pure_dict(rest_p, relocate(nnx.to_pure_dict(rest), table))
    assert rest_p["experts"]["gate_up"][...].shape[0] == table.shape[0]
    return lora_p, rest_p

  # Start from a 12-slot layout (identity plus copies of the cold experts 4..7) so both
  # runs share one compiled program; the load is what the router measures.
  start = jnp.array([0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7])
  (_, (y, load)), (g_lora, g_x) = run(*placed(start), x)
  table = jnp.asarray(balance.plan_placement(load, ranks=4, slots_per_rank=3))  # 4 spares
  before = balance.busiest_over_mean(balance.rank_loads(load, start, 4))
  after = balance.busiest_over_mean(balance.rank_loads(load, table, 4))
  assert before > 1.3 and after < before
  (_, (y2, load2)), (g_lora2, g_x2) = run(*placed(table), x)
  np.testing.assert_allclose(y2, y, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(g_x2, g_x, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(load2, load)
  g1, g2 = nnx.to_pure_dict(g_lora), nnx.to_pure_dict(g_lora2)
  for name in ("lora_a", "lora_b"):  # a replicated expert's gradient: the sum of its copies
    np.testing.assert_allclose(logical_rows(g2["experts"][name], table, 8),
                               logical_rows(g1["experts"][name], start, 8), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(g2["shared"]["gate_up"]["lora_b"], g1["shared"]["gate_up"]["lora_b"],
                             rtol=1e-4, atol=1e-5)


def test_relocating_adapters_and_moments_commutes_with_the_optimizer():
  keys = jax.random.split(jax.random.key(3), 4)
  params = {
      "experts": {
          "lora_a": jax.random.normal(keys[0], (8, 6, 2)),
          "lora_b": jax.random.normal(keys[1], (8, 2, 5))
      }
  }
  grads = [
      jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.fold_in(keys[2], i), p.shape),
                   params) for i in range(2)
  ]
  opt = optax.adamw(1e-2, weight_decay=0.1)
  identity, perm = jnp.arange(8), jnp.array([5, 2, 7, 0, 1, 6, 3, 4])
  move = lambda tree: relocate_module(tree, perm, 8, identity)

  @jax.jit
  def both(params, grads):
    state = opt.init(params)
    p = params
    updates, state = opt.update(grads[0], state, p)
    p = optax.apply_updates(p, updates)
    # Re-place mid-run: parameters and both Adam moments move together.
    p_moved = move(p)
    state_moved = (state[0]._replace(mu=move(state[0].mu), nu=move(state[0].nu)),) + state[1:]
    updates, state = opt.update(grads[1], state, p)
    p = optax.apply_updates(p, updates)
    updates, _ = opt.update(move(grads[1]), state_moved, p_moved)
    return move(p), optax.apply_updates(p_moved, updates)

  p, p_moved = both(params, grads)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p_moved)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_router_bias_step_moves_toward_the_mean_load():
  bias = jnp.zeros((2, 4))
  load = jnp.array([[5.0, 1.0, 3.0, 3.0], [0.0, 0.0, 8.0, 0.0]])
  np.testing.assert_allclose(balance.update_router_bias(bias, load, 0.01),
                             [[-0.01, 0.01, 0.0, 0.0], [0.01, 0.01, -0.01, 0.01]])


def test_sequence_balance_loss_on_a_hand_built_routing():
  # 2 sequences x 2 tokens, top-1, 2 experts; each sequence sends both tokens to one expert.
  experts = jnp.array([[0], [0], [1], [1]])
  probs = jnp.array([[0.9, 0.1], [0.7, 0.3], [0.2, 0.8], [0.4, 0.6]])
  # seq 0: 2 * (1.0 * 0.8 + 0 * 0.2) = 1.6; seq 1: 2 * (0 * 0.3 + 1.0 * 0.7) = 1.4.
  np.testing.assert_allclose(sequence_balance_loss(experts, probs, 2, seq_len=2), 1.5, rtol=1e-6)
  # The batch as a whole is balanced: the global loss is 2 * (0.5 * 0.55 + 0.5 * 0.45) = 1.0.
  np.testing.assert_allclose(sequence_balance_loss(experts, probs, 2, seq_len=4), 1.0, rtol=1e-6)

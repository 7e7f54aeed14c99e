"""The default (dropless) expert-parallel dispatcher under skewed routing, on 8 simulated
CPU devices: the pairs past a round's capacity move in further all-to-all rounds, and
the outputs and the gradients (tokens, routing weights, LoRA factors) equal the
single-device dropless reference; the compiled program's buffers stay at R*C rows."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hylora.core.config import KernelConfig, MeshConfig
from hylora.model.ffn import expert_parallel as ep
from hylora.model.ffn.dispatch import dropless
from meshes.mesh import build_mesh
from meshes.rules import activation_mesh
from tests.ep_helpers import emulated_ragged_all_to_all, ep_config, ep_layer

EXPERTS = 8
TRAINED = ("lora_a", "lora_b")


def _skewed_slots(n, k, rng, hot, cold=()):
  """[n, k] distinct slots per token: each choice in `hot` with probability 0.85, never
  one in `cold`."""
  allowed = [s for s in range(EXPERTS) if s not in cold]
  slots = np.zeros((n, k), np.int32)
  for t in range(n):
    pool = list(hot) if rng.uniform() < 0.85 else allowed
    slots[t] = rng.choice(pool if len(pool) >= k else allowed, size=k, replace=False)
  return slots


def _rounds_needed(slots, devices, chunks, ranks, cap, later):
  """Rounds the busiest (device, chunk, destination) needs: the first of C rows, then
  ceil(the rest / C') more."""
  per_rank = EXPERTS // ranks
  rows = slots.shape[0] // devices // chunks
  most = 0
  for start in range(0, slots.shape[0], rows):
    dest = slots[start:start + rows].reshape(-1) // per_rank
    most = max(most, np.bincount(dest, minlength=ranks).max())
  return 1 + -(-max(most - cap, 0) // later)


def _case(mesh_shape, slots, *, chunks=1, transport="padded", lora=None, dropout_key=None):
  """(ep_alltoall's (y, stats, grads), the dropless reference's (y, grads)); grads w.r.t.
  the tokens, the routing weights and the LoRA factors."""
  fsdp, expert = mesh_shape
  mesh = build_mesh(MeshConfig(fsdp=fsdp, expert=expert))
  cfg = ep_config("ep_alltoall", lora=lora, overlap_chunks=chunks, transport=transport)
  layer = ep_layer(cfg)
  w, opts = layer.experts.weights(), layer.experts.options(KernelConfig())
  frozen = {name: a for name, a in w.items() if name not in TRAINED}
  n, k = slots.shape
  x = jax.random.normal(jax.random.key(2), (n, cfg.model.d_model))
  weights = jax.random.uniform(jax.random.key(3), (n, k), minval=0.2, maxval=1.0)
  probe = jax.random.normal(jax.random.key(4), x.shape)
  trained = {name: w[name] for name in TRAINED}
  slots = jnp.asarray(slots)

  def run(dispatch, mesh):

    def loss(x, weights, trained):
      with activation_mesh(mesh):
        y, stats = dispatch(x, weights, slots, {
            **frozen,
            **trained
        }, opts, num_experts=EXPERTS, dropout_key=dropout_key, moe=cfg.model.moe)
      return jnp.sum(y * probe), (y, stats)

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, (y, stats)), grads = jax.jit(grad)(x, weights, trained)
    return y, stats, grads

  return run(ep.ep_alltoall, mesh), run(dropless, None), cfg


def _assert_matches_reference(ours, reference):
  (y, stats, grads), (y_ref, _, grads_ref) = ours, reference
  assert float(stats["dropped_tokens"]) == 0.0
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(grads[0], grads_ref[0], rtol=1e-5, atol=1e-5)  # tokens
  np.testing.assert_allclose(grads[1], grads_ref[1], rtol=1e-5, atol=1e-5)  # routing weights
  for name in TRAINED:
    assert np.abs(np.asarray(grads_ref[2][name])).max() > 0
    np.testing.assert_allclose(grads[2][name], grads_ref[2][name], rtol=1e-4, atol=1e-5)


def test_skewed_routing_takes_several_rounds_and_equals_the_reference():
  # 2 x 4 mesh, 2 chunks of 4 tokens (8 pairs) per device: C = 3 rows per destination;
  # most pairs go to rank 0 (slots 0, 1) and none to rank 3 (slots 6, 7), whose local
  # experts see empty groups in every round.
  rng = np.random.default_rng(0)
  slots = _skewed_slots(64, 2, rng, hot=(0, 1), cold=(6, 7))
  ours, reference, cfg = _case((2, 4), slots, chunks=2)
  cap, later = ep.round_rows(8, 4, cfg.model.moe), ep.later_round_rows(8, 4, cfg.model.moe)
  rounds = _rounds_needed(slots, 8, 2, 4, cap, later)
  assert (cap, later) == (3, 1) and rounds >= 3
  assert float(ours[1]["all_to_all_rounds"]) == rounds
  _assert_matches_reference(ours, reference)


def test_ragged_first_round_and_a_shared_lora_a(monkeypatch):
  # 1 x 8 mesh, 8 tokens (16 pairs) per device: C = 3; the first round on the ragged
  # transport (emulated), the later ones padded; one A shared by all experts.
  monkeypatch.setattr(ep, "ragged_collective", emulated_ragged_all_to_all)
  monkeypatch.setattr(ep, "RAGGED_PLATFORMS", ("cpu",))
  rng = np.random.default_rng(1)
  slots = _skewed_slots(64, 2, rng, hot=(2, 3))
  ours, reference, cfg = _case((1, 8), slots, transport="ragged", lora={"shared_expert_a": True})
  assert reference[2][2]["lora_a"].ndim == 2  # the shared A has no slot axis
  moe = cfg.model.moe
  rounds = _rounds_needed(slots, 8, 1, 8, ep.round_rows(16, 8, moe),
                          ep.later_round_rows(16, 8, moe))
  assert rounds >= 3 and float(ours[1]["all_to_all_rounds"]) == rounds
  _assert_matches_reference(ours, reference)


def test_balanced_routing_takes_one_round():
  # Every device sends each rank exactly its share: 4 pairs, under C = 5.
  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  cfg = ep_config("ep_alltoall")
  layer = ep_layer(cfg)
  w, opts = layer.experts.weights(), layer.experts.options(KernelConfig())
  t = np.arange(64)
  slots = jnp.asarray(np.stack([t % 8, (t + 3) % 8], axis=1), jnp.int32)
  x = jax.random.normal(jax.random.key(5), (64, cfg.model.d_model))
  weights = jnp.full((64, 2), 0.5)

  @jax.jit
  def run(x):
    with activation_mesh(mesh):
      return ep.ep_alltoall(x, weights, slots, w, opts, num_experts=EXPERTS, moe=cfg.model.moe)

  y, stats = run(x)
  y_ref, _ = dropless(x, weights, slots, w, opts, num_experts=EXPERTS)
  assert float(stats["all_to_all_rounds"]) == 1.0 and float(stats["dropped_tokens"]) == 0.0
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)


def test_backward_uses_the_forward_dropout_masks():
  # With LoRA dropout the gradient must differentiate the masks the forward drew: a
  # central difference along a random direction agrees with it.
  rng = np.random.default_rng(3)
  slots = _skewed_slots(64, 2, rng, hot=(0, 1))
  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  cfg = ep_config("ep_alltoall", lora={"dropout": 0.5})
  layer = ep_layer(cfg)
  w, opts = layer.experts.weights(), layer.experts.options(KernelConfig())
  assert opts["lora_dropout"] == 0.5
  x = jax.random.normal(jax.random.key(6), (64, cfg.model.d_model))
  probe = jax.random.normal(jax.random.key(7), x.shape)
  weights, slots, key = jnp.full((64, 2), 0.5), jnp.asarray(slots), jax.random.key(8)

  def loss(x, lora_a):
    expert_weights = {**w, "lora_a": lora_a}
    with activation_mesh(mesh):
      y, stats = ep.ep_alltoall(x, weights, slots, expert_weights, opts, num_experts=EXPERTS,
                                dropout_key=key, moe=cfg.model.moe)
    return jnp.sum(y * probe), stats["all_to_all_rounds"]

  dx = jax.random.normal(jax.random.key(9), x.shape)
  # A's scale (its init) keeps the step in the linear range
  da = jax.random.normal(jax.random.key(10), w["lora_a"].shape) / np.sqrt(cfg.model.d_model)
  eps = 1e-3

  @jax.jit
  def check(x, a):  # one program: the gradient and the two shifted losses
    (_, rounds), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(x, a)
    analytic = jnp.sum(grads[0] * dx) + jnp.sum(grads[1] * da)
    shifted = lambda s: loss(x + s * dx, a + s * da)[0]
    numeric = (shifted(eps) - shifted(-eps)) / (2 * eps)
    return rounds, analytic, numeric

  rounds, analytic, numeric = check(x, w["lora_a"])
  assert float(rounds) >= 3
  np.testing.assert_allclose(analytic, numeric, rtol=1e-3)


def _compiled(cfg, mesh, n, k):
  layer = ep_layer(cfg)
  w, opts = layer.experts.weights(), layer.experts.options(KernelConfig())
  frozen = {name: a for name, a in w.items() if name not in TRAINED}
  trained = {name: w[name] for name in TRAINED}

  def loss(x, weights, slots, trained):
    with activation_mesh(mesh):
      y, _ = ep.ep_alltoall(x, weights, slots, {
          **frozen,
          **trained
      }, opts, num_experts=EXPERTS, moe=cfg.model.moe)
    return jnp.sum(y)

  args = (jax.ShapeDtypeStruct(
      (n, cfg.model.d_model), jnp.float32), jax.ShapeDtypeStruct(
          (n, k), jnp.float32), jax.ShapeDtypeStruct((n, k), jnp.int32), trained)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 3))).lower(*args).compile()


def _shapes(hlo, op=""):
  """Every array shape in an HLO text (of the results of `op` alone, if given)."""
  if op:
    hlo = "\n".join(line.split(f" {op}(")[0] for line in hlo.splitlines() if f" {op}(" in line)
  return {
      tuple(int(v) for v in dims.split(",")) for dims in re.findall(r"[a-z]\w*\[([\d,]+)\]", hlo)
  }


def test_buffers_hold_one_round_whatever_the_routing():
  # 2 x 4 mesh, 32 tokens per device with top-4: 128 pairs, C = 40 rows per destination;
  # sized for the worst case (every pair to one rank) buffers would have R * 128 rows.
  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  ranks, n, k = 4, 256, 4
  rounds_cfg = ep_config("ep_alltoall", top_k=k)
  worst_cfg = ep_config("ep_alltoall", top_k=k, capacity_factor=float(ranks))  # C = all pairs
  d, f = rounds_cfg.model.d_model, rounds_cfg.model.moe.expert_ffn
  pairs = n // 8 * k
  cap = ep.round_rows(pairs, ranks, rounds_cfg.model.moe)
  later = ep.later_round_rows(pairs, ranks, rounds_cfg.model.moe)  # 0.25 x the mean
  assert (cap, later) == (40, 8) and ep.capacity(pairs, ranks, float(ranks)) == pairs
  rounds, worst = _compiled(rounds_cfg, mesh, n, k), _compiled(worst_cfg, mesh, n, k)
  # No array of the per-device program (forward and backward) exceeds R * C rows
  assert max(max(s) for s in _shapes(rounds.as_text())) == ranks * cap
  assert max(max(s) for s in _shapes(worst.as_text())) == ranks * pairs
  # Row transfers move C rows per block in the first round, C' in later ones, d wide (2d:
  # rows with their cotangents).
  moved = {s[-2:] for s in _shapes(rounds.as_text(), "all-to-all") if len(s) == 3}
  assert moved == {(cap, d), (later, d), (later, 2 * d)}
  temp = lambda c: c.memory_analysis().temp_size_in_bytes
  assert temp(rounds) < 0.6 * temp(worst)
  assert ep.round_buffer_bytes(rounds_cfg.model.moe, d, n // 8, ranks,
                               itemsize=4) == ranks * (cap + later) * (6 * d + 3 * f) * 4


def test_frozen_base_weights_are_refused_a_gradient_through_the_rounds():
  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  cfg = ep_config("ep_alltoall")
  layer = ep_layer(cfg)
  w, opts = layer.experts.weights(), layer.experts.options(KernelConfig())
  x, weights = jnp.ones((64, cfg.model.d_model)), jnp.ones((64, 2))
  slots = jnp.zeros((64, 2), jnp.int32)

  def loss(gate_up):
    with activation_mesh(mesh):
      y, _ = ep.ep_alltoall(x, weights, slots, {
          **w, "gate_up": gate_up
      }, opts, num_experts=EXPERTS, moe=cfg.model.moe)
    return jnp.sum(y)

  with pytest.raises(ValueError, match="LoRA factors only, not the frozen gate_up"):
    jax.eval_shape(jax.grad(loss), w["gate_up"])

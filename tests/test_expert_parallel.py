"""The expert-parallel dispatcher ("ep_alltoall") on 8 simulated CPU devices: by default
equal to the single-device dropless layer, exactly the documented drops with a binding
explicit capacity, and its own all-to-alls per overlap chunk in the compiled program
(skewed routing over several rounds: tests/test_dropless_rounds.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hylora.core.config import KernelConfig, MeshConfig, MoEConfig
from hylora.core.errors import ConfigError
from hylora.model.context import ForwardContext
from hylora.model.ffn import expert_parallel as ep
from hylora.model.ffn.dispatch import dropless
from hylora.model.lora import LoRAParam
from meshes.mesh import build_mesh
from meshes.rules import activation_mesh
from tests.ep_helpers import emulated_ragged_all_to_all, ep_config, ep_layer

B, T = 4, 16  # 64 tokens: 8 per device


def _value_and_grads(layer, mesh):
  graphdef, lora, rest = nnx.split(layer, LoRAParam, ...)
  ctx = ForwardContext(jnp.ones((B, T), jnp.int32), jnp.zeros((B, T), jnp.int32))
  x = jax.random.normal(jax.random.key(0), (B, T, layer.experts.gate_up.shape[1]))
  probe = jax.random.normal(jax.random.key(1), x.shape)

  def loss(lora, x):
    y, aux = nnx.merge(graphdef, lora, rest)(x, ctx)
    return jnp.sum(y * probe), (y, aux["dropped_tokens"])

  def run(lora, x):
    with activation_mesh(mesh):
      return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(lora, x)

  (_, (y, dropped)), grads = jax.jit(run)(lora, x)
  return y, dropped, grads


@pytest.fixture(scope="module")
def reference():
  return _value_and_grads(ep_layer(ep_config("dropless")), None)


@pytest.mark.parametrize("fsdp,expert,chunks", [(2, 4, 2), (1, 8, 1)])
def test_ep_layer_equals_dropless_reference(reference, fsdp, expert, chunks):
  mesh = build_mesh(MeshConfig(fsdp=fsdp, expert=expert))
  y, dropped, grads = _value_and_grads(ep_layer(ep_config("ep_alltoall", overlap_chunks=chunks)),
                                       mesh)
  y_ref, dropped_ref, grads_ref = reference
  assert float(dropped) == 0.0
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(grads[1], grads_ref[1], rtol=1e-5, atol=1e-5)  # input
  leaves, leaves_ref = jax.tree.leaves(grads[0]), jax.tree.leaves(grads_ref[0])
  assert len(leaves) == len(leaves_ref) >= 4
  for g, g_ref in zip(leaves, leaves_ref):  # every LoRA factor
    assert np.abs(np.asarray(g_ref)).max() > 0
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5)


def _expected_kept(slots, devices, chunks, ranks, per_rank, cap):
  """The documented rule: per device and chunk, pairs sorted by (slot, token, choice);
  for each destination rank the first `cap` are kept."""
  n, k = slots.shape
  keep = np.zeros((n, k), bool)
  rows = n // devices // chunks
  for start in range(0, n, rows):
    pairs = [(slots[t, j], t, j) for t in range(start, start + rows) for j in range(k)]
    sent = np.zeros(ranks, int)
    for slot, t, j in sorted(pairs):
      rank = slot // per_rank
      if sent[rank] < cap:
        keep[t, j] = True
      sent[rank] += 1
  return keep


@pytest.mark.parametrize("transport", ["padded", "ragged"])
def test_small_capacity_drops_exactly_the_documented_pairs(transport, monkeypatch):
  if transport == "ragged":  # the ragged offsets logic, on an emulated collective
    monkeypatch.setattr(ep, "ragged_collective", emulated_ragged_all_to_all)
    monkeypatch.setattr(ep, "RAGGED_PLATFORMS", ("cpu",))
  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  cfg = ep_config("ep_alltoall", capacity_factor=0.5, overlap_chunks=1, transport=transport)
  layer = ep_layer(cfg)
  n, d, e, k = 64, cfg.model.d_model, cfg.model.moe.experts, cfg.model.moe.top_k
  x = jax.random.normal(jax.random.key(2), (n, d))
  # Skewed routing: most pairs want experts 0 and 1 (rank 0), so rank 0 overflows.
  rng = np.random.default_rng(0)
  first = rng.choice([0, 1, 2, 5], size=n, p=[0.55, 0.25, 0.1, 0.1])
  slots = np.stack([first, (first + 1 + rng.integers(0, e - 1, n)) % e], axis=1)
  weights = rng.uniform(0.2, 1.0, (n, k)).astype(np.float32)
  cap = ep.capacity(n // 8 * k, 4, 0.5)
  assert cap < n // 8 * k  # the capacity really binds
  keep = _expected_kept(slots, 8, 1, 4, e // 4, cap)
  assert 0 < (~keep).sum() and (~keep.any(axis=1)).any()  # some tokens lose every pair
  w, opts = layer.experts.weights(), layer.experts.options(KernelConfig())

  @jax.jit
  def run(x, weights, slots):
    with activation_mesh(mesh):
      return ep.ep_alltoall(x, weights, slots, w, opts, num_experts=e, moe=cfg.model.moe)

  y, stats = run(x, jnp.asarray(weights), jnp.asarray(slots, jnp.int32))
  y_ref, _ = dropless(x, jnp.asarray(weights * keep), jnp.asarray(slots, jnp.int32), w, opts,
                      num_experts=e)
  assert float(stats["dropped_tokens"]) == (~keep).sum()
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(y)[~keep.any(axis=1)], 0.0)  # residual only


def _all_to_all_count(chunks, capacity_factor):
  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  cfg = ep_config("ep_alltoall", overlap_chunks=chunks, capacity_factor=capacity_factor)
  layer = ep_layer(cfg)
  w, opts = layer.experts.weights(), layer.experts.options(KernelConfig())
  x = jnp.zeros((64, cfg.model.d_model))
  weights = jnp.ones((64, 2))
  slots = jnp.zeros((64, 2), jnp.int32)

  def run(x, weights, slots):
    with activation_mesh(mesh):
      return ep.ep_alltoall(x, weights, slots, w, opts, num_experts=8, moe=cfg.model.moe)[0]

  hlo = jax.jit(run).lower(x, weights, slots).compile().as_text()
  return sum(" all-to-all(" in line or " all-to-all-start(" in line for line in hlo.splitlines())


@pytest.mark.parametrize("capacity_factor,per_chunk", [(1.5, 3), (0.0, 5)])
def test_each_overlap_chunk_has_its_own_all_to_alls(capacity_factor, per_chunk):
  # Per chunk: the count exchange, the rows out and the results back; dropless, also the
  # rows out and back of its loop of further rounds.
  assert _all_to_all_count(2, capacity_factor) == per_chunk * 2


def test_only_ragged_on_gpu_asks_for_xla_options():
  ragged, padded = MoEConfig(transport="ragged"), MoEConfig(transport="padded")
  assert ep.xla_options(ragged, "gpu") == {
      "xla_gpu_unsupported_enable_ragged_all_to_all_decomposer": True
  }
  assert ep.xla_options(padded, "gpu") == ep.xla_options(ragged, "cpu") == {}


def test_ragged_transport_is_refused_on_cpu_with_a_clear_error():
  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  with pytest.raises(ConfigError, match="model.moe.transport"):
    ep.check_transport("ragged", mesh)

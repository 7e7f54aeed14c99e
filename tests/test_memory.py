"""Remat policies and the memory planner.

Every policy gives the loss and LoRA gradients of `none` on the small model under the
layer scan on a 2 x 4 mesh; the tiered policy's program lowered for a GPU moves the host
names to pinned host memory; on CPU it keeps them on the device and says so; the planner
fits its budget, trades memory for recomputation as the budget tightens, and is
deterministic.
"""

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from hylora.model import remat_policy
from hylora.core import save_points
from hylora.core.config import MemoryConfig, MeshConfig
from hylora.core.errors import ConfigError
from hylora.plan.remat_planner import estimate_policy, plan_memory, replan_after_compile
from hylora.plan.save_point_sizes import layer_save_points
from hylora.core.presets import get_preset
from hylora.train import state as st
from hylora.train.step import BATCH_KEYS, make_loss_fn
from meshes.mesh import build_mesh
from meshes.rules import activation_mesh
from tests.helpers import small_config, token_batch

TIERED = MemoryConfig(
    remat="tiered", hbm_names=(save_points.QKV, save_points.TOPK, save_points.EXPERT_INPUT),
    host_names=(save_points.ATTENTION, save_points.EXPERT_GATE_UP, save_points.MLP_GATE_UP))
POLICIES = {
    "none": MemoryConfig(remat="none"),
    "full": MemoryConfig(remat="full"),
    "minimal": MemoryConfig(remat="minimal"),
    "tiered": TIERED
}
# XLA:CPU's LLVM passes dominate the compile; the numbers do not depend on them. Excess
# precision off: a policy's saved tensors are rounded to bf16 where the program says so,
# and without it XLA may skip those roundings in `none` but not where a policy saves.
FAST_COMPILE = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_allow_excess_precision": False
}


def _config(policy: MemoryConfig = MemoryConfig()):
  """Both mixers and the MoE (with a shared expert) in a period scanned twice."""
  cfg = small_config()
  model = dataclasses.replace(cfg.model, layers=4, dense_layers=0, pattern=("linear", "sparse"))
  return dataclasses.replace(cfg, model=model, memory=policy)


def _grad_fn(cfg, mesh):
  objective = jax.value_and_grad(make_loss_fn(cfg, st.model_parts(cfg)), has_aux=True)

  def run(lora, frozen, batch):
    with activation_mesh(mesh):
      (_, info), grads = objective(lora, frozen, batch, jnp.sum(batch["labels"] >= 0), None)
    return info["loss_sum"] / info["tokens"], grads

  return run


@pytest.fixture(scope="module")
def policy_results():
  """Loss and LoRA gradients of every policy, from one compiled program."""
  base = _config()
  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  parts = st.model_parts(base)
  lora, frozen = st.init_params(base, parts, mesh)
  # Non-zero adapters, so that every A and B receives a gradient (drawn on the host: no
  # compile per leaf shape).
  rng = np.random.default_rng(1)
  lora = jax.tree.map(
      lambda a: jax.device_put((0.2 * rng.standard_normal(a.shape)).astype(a.dtype), a.sharding),
      lora)
  batch = token_batch(base, mesh, documents=2)
  fns = {name: _grad_fn(_config(policy), mesh) for name, policy in POLICIES.items()}
  step = jax.jit(lambda lora, frozen, batch: {n: f(lora, frozen, batch) for n, f in fns.items()})
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the CPU fallback of the host names, tested below
    compiled = step.lower(lora, frozen, batch).compile(compiler_options=FAST_COMPILE)
  return jax.device_get(compiled(lora, frozen, batch))


@pytest.mark.parametrize("policy", ["full", "minimal", "tiered"])
def test_policy_matches_none(policy_results, policy):
  loss_ref, grads_ref = policy_results["none"]
  loss, grads = policy_results[policy]
  assert np.isfinite(loss_ref) and loss_ref > 0
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
  flat_ref = jax.tree_util.tree_leaves_with_path(grads_ref)
  flat = jax.tree.leaves(grads)
  assert len(flat) == len(flat_ref) > 0
  for (path, g_ref), g in zip(flat_ref, flat):
    assert np.any(g_ref != 0), jax.tree_util.keystr(path)
    err = np.linalg.norm(g - g_ref) / np.linalg.norm(g_ref)
    assert err < 1e-5, (jax.tree_util.keystr(path), err)


def _lowered_for_gpu(policy: MemoryConfig) -> str:
  """The small model's loss gradient under `policy`, lowered (not compiled) for CUDA."""
  cfg = _config(policy)
  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  lora, frozen = st.abstract_arrays(st.model_parts(cfg), mesh)
  b, t = cfg.train.batch_size, cfg.train.seq_len
  spec = jax.ShapeDtypeStruct((b, t), jnp.int32,
                              sharding=NamedSharding(mesh, P(("fsdp", "expert"))))
  batch = {k: spec for k in BATCH_KEYS}
  traced = jax.jit(_grad_fn(cfg, mesh)).trace(lora, frozen, batch)
  return traced.lower(lowering_platforms=("cuda",)).as_text()


def test_tiered_policy_offloads_its_host_names_to_pinned_host_on_gpu():
  text = _lowered_for_gpu(dataclasses.replace(TIERED, host_offload="on"))
  placements = re.findall(
      r"annotate_device_placement\(.*?_xla_buffer_placement = \"(\w+)\""
      r".*?-> (tensor<[^>]*>)", text)
  to_host = {shape for kind, shape in placements if kind == "pinned_host"}
  to_device = {shape for kind, shape in placements if kind == "device"}
  cfg = _config()
  b, t, la = cfg.train.batch_size, cfg.train.seq_len, cfg.model.linear_attention
  moe = cfg.model.moe
  attention = f"tensor<{b}x{t}x{la.heads}x{la.head_dim}xbf16>"  # linear attention output
  gate_up = f"tensor<{b * t * moe.top_k}x{2 * moe.expert_ffn}xbf16>"  # routed experts
  assert attention in to_host and gate_up in to_host, to_host
  assert to_host == to_device  # each one comes back for the backward
  # without host names nothing moves
  text = _lowered_for_gpu(dataclasses.replace(TIERED, host_names=()))
  assert "pinned_host" not in text


def test_tiered_policy_keeps_host_names_on_device_on_cpu_and_says_so():
  remat_policy._warned.clear()
  with pytest.warns(UserWarning, match="stay in device memory"):
    remat_policy.remat_policy(TIERED, backend="cpu")
  assert remat_policy.tiers(TIERED, backend="cpu") == (TIERED.hbm_names + TIERED.host_names, ())
  assert remat_policy.tiers(TIERED, backend="gpu") == (TIERED.hbm_names, TIERED.host_names)
  assert remat_policy.tiers(dataclasses.replace(TIERED, host_offload="on"), backend="cpu")[1]
  assert not remat_policy.tiers(dataclasses.replace(TIERED, host_offload="off"), backend="gpu")[1]
  # the offloading policy saves the host names to host memory, the others on the device
  x = jnp.ones((4, 4))

  def f(x):
    a = save_points.tag(jnp.sin(x @ x), save_points.ATTENTION)
    q = save_points.tag(jnp.sin(a @ x), save_points.QKV)
    return jnp.sum(jnp.sin(q @ x))

  def offloads(backend):
    policy = remat_policy.remat_policy(TIERED, backend=backend)
    text = str(jax.make_jaxpr(jax.grad(jax.checkpoint(f, policy=policy)))(x))
    return re.findall(r"name\[name=(\w+)\] \w+\s+\w+:f32<host>\[4,4\] = device_put", text)

  assert offloads("gpu") == [save_points.ATTENTION]
  assert offloads("cpu") == []


@pytest.mark.parametrize("field, value", [("hbm_names", ("qkv", "not_a_point")),
                                          ("host_names", ("atention",)),
                                          ("host_names", "attention"), ("remat", "some"),
                                          ("host_offload", "maybe")])
def test_bad_memory_config_raises_config_error_naming_the_field(field, value):
  cfg = dataclasses.replace(TIERED, **{field: value})
  with pytest.raises(ConfigError, match=f"memory.{field}"):
    remat_policy.remat_policy(cfg)


def test_name_in_both_tiers_is_refused():
  with pytest.raises(ConfigError, match="memory.host_names"):
    remat_policy.check(dataclasses.replace(TIERED, host_names=(save_points.QKV,)))


def test_every_save_point_name_is_used_by_the_model():
  """Each name of the vocabulary tags a tensor in the small model (dense layer included)."""
  cfg = small_config()
  seen = set()
  original = save_points.checkpoint_name

  def record(x, name):
    seen.add(name)
    return original(x, name)

  parts = st.model_parts(cfg)
  lora, frozen = st.abstract_arrays(parts)
  b, t = 2, cfg.train.seq_len
  batch = {k: jax.ShapeDtypeStruct((b, t), jnp.int32) for k in BATCH_KEYS}
  objective = make_loss_fn(cfg, parts)
  save_points.checkpoint_name = record
  try:
    jax.eval_shape(lambda l, f, bt: objective(l, f, bt, 1.0, None), lora, frozen, batch)
  finally:
    save_points.checkpoint_name = original
  assert seen == set(save_points.ALL), set(save_points.ALL) - seen


# ---- the planner -----------------------------------------------------------------------


def _gpu_like():
  """The gpu-1 preset's widths at a longer sequence, planned on one device."""
  from hylora.core.presets import gpu_1
  cfg = gpu_1()
  return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=16384))


@pytest.fixture(scope="module")
def gpu_plans():
  cfg = _gpu_like()
  full = estimate_policy(cfg, (1, 1), 1e12, MemoryConfig(remat="full")).predicted_peak_bytes
  none = estimate_policy(cfg, (1, 1), 1e12, MemoryConfig(remat="none")).predicted_peak_bytes
  budgets = [full * 1.01 + (none * 1.2 - full * 1.01) * i / 4 for i in range(5)]
  return cfg, {b: plan_memory(cfg, (1, 1), b) for b in budgets}


def test_plan_fits_its_budget_and_beats_full_remat(gpu_plans):
  cfg, plans = gpu_plans
  for budget, plan in plans.items():
    assert plan.fits and plan.predicted_peak_bytes <= budget
    full = estimate_policy(cfg, (1, 1), budget, MemoryConfig(remat="full"))
    assert plan.predicted_step_seconds <= full.predicted_step_seconds
    config = plan.policy_config()
    assert config.remat == "tiered" and remat_policy.check(config) is config
    assert set(config.hbm_names) | set(config.host_names) | set(plan.recompute_names) \
        == {p.name for p in plan.save_points}


def test_tighter_budget_means_more_recompute_or_offload(gpu_plans):
  _, plans = gpu_plans
  ordered = [plans[b] for b in sorted(plans, reverse=True)]
  hbm = [p.saved_hbm_bytes for p in ordered]
  steps = [p.predicted_step_seconds for p in ordered]
  assert hbm == sorted(hbm, reverse=True) and hbm[0] > hbm[-1]
  assert steps == sorted(steps) and steps[-1] > steps[0]
  assert ordered[-1].recompute_seconds > ordered[0].recompute_seconds
  assert ordered[0].recompute_seconds == 0.0  # a roomy budget recomputes nothing


def test_plan_is_deterministic_and_prints_a_table(gpu_plans):
  cfg, plans = gpu_plans
  budget = sorted(plans)[2]
  again = plan_memory(cfg, (1, 1), budget)
  assert again == plans[budget]
  table = again.table()
  for p in again.save_points:
    assert re.search(rf"{p.name}\s.*\s{p.tier}$", table, re.M)
  assert "predicted peak" in table and "fits" in table


def test_replan_takes_xla_overshoot_off_the_budget(gpu_plans):
  cfg, plans = gpu_plans
  budget = sorted(plans)[3]
  plan = plans[budget]
  # XLA compiled the plan to 5% of the budget over the budget
  overshoot = budget - plan.predicted_peak_bytes + 0.05 * budget
  again = replan_after_compile(cfg, (1, 1), budget, plan, plan.predicted_peak_bytes + overshoot)
  assert again.fits
  # the same error on the new plan still fits the real budget
  assert again.predicted_peak_bytes + overshoot <= budget
  assert again.saved_hbm_bytes < plan.saved_hbm_bytes
  assert again.predicted_step_seconds >= plan.predicted_step_seconds
  # XLA at or below the prediction: the same plan (less the slack)
  same = replan_after_compile(cfg, (1, 1), budget, plan, plan.predicted_peak_bytes, slack=0.0)
  assert same == plans[budget]
  with pytest.raises(ConfigError, match="over the planner"):
    replan_after_compile(cfg, (1, 1), budget, plan, plan.predicted_peak_bytes + 2 * budget)


def test_plan_that_cannot_fit_says_so():
  plan = plan_memory(_gpu_like(), (1, 1), 60e9)
  assert not plan.fits and plan.hbm_names == () and plan.host_names == ()
  assert "DOES NOT FIT" in plan.table()
  with pytest.raises(ConfigError, match="device_memory_bytes"):
    plan_memory(_gpu_like(), (1, 1), 0)
  with pytest.raises(ConfigError, match="mesh_shape"):
    plan_memory(_gpu_like(), (0, 1), 1e9)


def test_masked_dense_sparse_attention_counts_its_mask_bias():
  # gpu-1: 8192 tokens, K = 2048 -> by_density picks masked dense, which keeps the
  # selection as a bf16 bias [B, 1, T, T] beside the output; the gather kernels do not
  cfg = get_preset("gpu-1")
  n, seq = cfg.train.batch_size * cfg.train.seq_len, cfg.train.seq_len
  gather = dataclasses.replace(cfg, kernels=dataclasses.replace(cfg.kernels,
                                                                sparse_attention="pallas"))
  dense_bytes, dense_flops = layer_save_points(cfg, "sparse", "moe", n)[save_points.ATTENTION]
  gather_bytes, gather_flops = layer_save_points(gather, "sparse", "moe", n)[save_points.ATTENTION]
  assert dense_bytes - gather_bytes == n * seq * 2
  assert dense_flops == gather_flops * (seq // 2) / cfg.model.sparse_attention.top_k

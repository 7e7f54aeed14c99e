import os

import jax
import pytest
from jax.sharding import PartitionSpec as P

from meshes import logical_axes as ax
from hylora.core.config import MeshConfig
from hylora.core.errors import ConfigError
from hylora.core.overrides import apply_overrides
from hylora.train.state import model_parts, shardings
from hylora.train.trainer import check_model_fits_mesh
from meshes import PARAM_RULES, build_mesh, logical_to_spec
from meshes.mesh import MeshShapeError, add_xla_flags
from tests.helpers import small_config


def test_mesh_from_simulated_devices():
  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  assert dict(mesh.shape) == {"fsdp": 2, "expert": 4}
  assert dict(build_mesh(MeshConfig(fsdp=-1, expert=8)).shape) == {"fsdp": 1, "expert": 8}


def test_mesh_larger_than_devices():
  with pytest.raises(MeshShapeError, match="asks for 16 devices, this host has 8 cpu"):
    build_mesh(MeshConfig(fsdp=4, expert=4))


def test_a_fixed_mesh_smaller_than_the_host_takes_its_first_devices():
  mesh = build_mesh(MeshConfig(fsdp=1, expert=4))
  assert list(mesh.devices.flat) == jax.devices()[:4]
  assert list(build_mesh(MeshConfig(fsdp=-1, expert=2, devices=6)).devices.flat) == \
      jax.devices()[:6]
  with pytest.raises(MeshShapeError, match="mesh.expert: 4 does not divide the 6"):
    build_mesh(MeshConfig(fsdp=-1, expert=4, devices=6))


def test_a_mesh_over_given_devices_must_use_all_of_them():
  with pytest.raises(MeshShapeError, match="must use all of them"):
    build_mesh(MeshConfig(fsdp=1, expert=4), jax.devices())


def test_experts_not_divisible_by_expert_axis():
  cfg = apply_overrides(small_config(), {"model.moe.experts": "12"})
  mesh = build_mesh(MeshConfig(fsdp=-1, expert=8))
  with pytest.raises(ConfigError, match="model.moe.experts: 12 experts"):
    check_model_fits_mesh(cfg, mesh)


def test_rules_expert_weights_and_fsdp():
  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  assert logical_to_spec((ax.EXP, ax.EMBED, ax.EXP_MLP), (8, 32, 64), mesh,
                         PARAM_RULES) == P("expert", "fsdp", None)
  assert logical_to_spec((ax.EMBED, ax.HEADS, ax.HEAD_DIM), (32, 4, 16), mesh, PARAM_RULES) == P(
      ("fsdp", "expert"), None, None)
  # Not divisible by both axes: falls back to the next candidate.
  assert logical_to_spec((ax.EMBED, ax.MLP), (6, 64), mesh, PARAM_RULES) == P("fsdp", "expert")
  assert logical_to_spec((ax.LAYERS, ax.EMBED), (3, 32), mesh,
                         PARAM_RULES) == P(None, ("fsdp", "expert"))


def test_every_model_parameter_gets_a_sharding():
  cfg = small_config()
  mesh = build_mesh(cfg.mesh)
  parts = model_parts(cfg)
  lora_sh, frozen_sh = shardings(parts, mesh)
  flat = jax.tree_util.tree_leaves_with_path(frozen_sh)
  experts = [
      s for p, s in flat
      if "experts" in jax.tree_util.keystr(p) and "gate_up" in jax.tree_util.keystr(p)
  ]
  assert experts and all(s.spec == P(None, "expert", "fsdp", None) for s in experts)
  embed = [s for p, s in flat if jax.tree_util.keystr(p) == "['embed']"]
  assert embed[0].spec == P(("fsdp", "expert"), None)


def test_xla_flags_are_added_once_and_a_flag_already_set_is_kept(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true --xla_dump_to=/x")
  add_xla_flags("--xla_cpu_multi_thread_eigen=false", "--xla_backend_optimization_level=0")
  add_xla_flags("--xla_backend_optimization_level=0")
  assert os.environ["XLA_FLAGS"].split() == [
      "--xla_cpu_multi_thread_eigen=true", "--xla_dump_to=/x", "--xla_backend_optimization_level=0"
  ]

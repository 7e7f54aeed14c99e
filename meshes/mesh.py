"""The 2-D device mesh `(fsdp, expert)` built from the devices present."""

from __future__ import annotations

import os

import jax
import numpy as np

from hylora.config import MeshConfig
from hylora.errors import ConfigError

AXES = ("fsdp", "expert")


def ensure_cpu_devices(count: int) -> None:
  """Asks for `count` simulated CPU devices; must run before JAX initialises a backend."""
  if count <= 0:
    return
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
  jax.config.update("jax_num_cpu_devices", count)


def use_simulated_devices(cfg: MeshConfig) -> None:
  """`mesh.devices > 0`: run on that many simulated CPU devices, whatever accelerators
  exist. Must run before JAX initialises a backend."""
  if cfg.devices > 0:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    ensure_cpu_devices(cfg.devices)


def mesh_shape(cfg: MeshConfig, device_count: int) -> tuple[int, int]:
  if cfg.expert < 1:
    raise ConfigError(f"mesh.expert: must be >= 1, got {cfg.expert}")
  if cfg.fsdp == -1:
    if device_count % cfg.expert:
      raise ConfigError(f"mesh.expert: {cfg.expert} does not divide the {device_count} "
                        "devices present")
    return device_count // cfg.expert, cfg.expert
  if cfg.fsdp < 1:
    raise ConfigError(f"mesh.fsdp: must be >= 1 or -1 (fill), got {cfg.fsdp}")
  size = cfg.fsdp * cfg.expert
  if size > device_count:
    raise ConfigError(f"mesh: fsdp={cfg.fsdp} x expert={cfg.expert} = {size} devices, but only "
                      f"{device_count} are present")
  if size != device_count:
    raise ConfigError(f"mesh: fsdp={cfg.fsdp} x expert={cfg.expert} = {size} devices, but "
                      f"{device_count} are present; the mesh must use all of them")
  return cfg.fsdp, cfg.expert


def build_mesh(cfg: MeshConfig, devices=None) -> jax.sharding.Mesh:
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(cfg, len(devices))
  grid = np.asarray(devices, dtype=object).reshape(shape)
  return jax.sharding.Mesh(grid, AXES)

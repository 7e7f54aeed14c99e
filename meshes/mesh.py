"""The 2-D device mesh `(fsdp, expert)` built from the devices present."""

from __future__ import annotations

import os

import jax
import numpy as np

AXES = ("fsdp", "expert")


class MeshShapeError(ValueError):
  """The requested (fsdp, expert) shape does not fit the devices present."""


def add_xla_flags(*flags: str) -> None:
  """Adds `--name=value` flags to XLA_FLAGS, keeping any the environment already sets;
  only before JAX initialises a backend."""
  have = os.environ.get("XLA_FLAGS", "")
  extra = [f for f in flags if f.split("=")[0] not in have]
  os.environ["XLA_FLAGS"] = " ".join([have, *extra]).strip()


def ensure_cpu_devices(count: int) -> None:
  """Asks for `count` simulated CPU devices; must run before JAX initialises a backend."""
  if count <= 0:
    return
  add_xla_flags(f"--xla_force_host_platform_device_count={count}")
  jax.config.update("jax_num_cpu_devices", count)


def use_simulated_devices(count: int) -> None:
  """`count > 0`: run on that many simulated CPU devices, whatever accelerators exist.
  Must run before JAX initialises a backend."""
  if count > 0:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    ensure_cpu_devices(count)


def request_devices(count: int) -> None:
  """`count > 0`: the run wants `count` devices: the host's first ones where it has
  accelerators, else that many simulated CPU devices (asked for here). Must run before
  JAX initialises a backend."""
  ensure_cpu_devices(count)


def mesh_devices(request, devices: list) -> list:
  """The devices a mesh of `request` uses out of `devices` (all processes', in order).

  One process: the first `request.devices` when that is > 0, else the first fsdp x
  expert of a fixed mesh, else all. Several processes: all of them, each process
  contributing `request.devices` (when > 0) of its own."""
  per_host = getattr(request, "devices", 0)
  kind = devices[0].platform if devices else "no"
  if jax.process_count() > 1:
    local = len(jax.local_devices())
    if per_host > 0 and per_host != local:
      raise MeshShapeError(f"mesh.devices: {per_host} per process, but this process has "
                           f"{local} {kind} devices; a multi-process run uses all of them")
    return devices
  want = per_host if per_host > 0 else request.fsdp * request.expert if request.fsdp >= 1 else 0
  if want <= 0 or want == len(devices):
    return devices
  if want > len(devices):
    hint = " (JAX_PLATFORMS=cpu simulates them on the CPU)" if kind != "cpu" else ""
    raise MeshShapeError(f"mesh: the run asks for {want} devices, this host has "
                         f"{len(devices)} {kind} device(s){hint}")
  return devices[:want]


def mesh_shape(request, device_count: int) -> tuple[int, int]:
  """(fsdp, expert) for `request` (anything with `fsdp` and `expert` sizes; fsdp=-1 fills
  what the devices leave) on `device_count` devices."""
  if request.expert < 1:
    raise MeshShapeError(f"mesh.expert: must be >= 1, got {request.expert}")
  if request.fsdp == -1:
    if device_count % request.expert:
      raise MeshShapeError(f"mesh.expert: {request.expert} does not divide the {device_count} "
                           "devices present")
    return device_count // request.expert, request.expert
  if request.fsdp < 1:
    raise MeshShapeError(f"mesh.fsdp: must be >= 1 or -1 (fill), got {request.fsdp}")
  size = request.fsdp * request.expert
  if size > device_count:
    raise MeshShapeError(
        f"mesh: fsdp={request.fsdp} x expert={request.expert} = {size} devices, but only "
        f"{device_count} are present")
  if size != device_count:
    raise MeshShapeError(
        f"mesh: fsdp={request.fsdp} x expert={request.expert} = {size} devices, but "
        f"{device_count} are present; the mesh must use all of them")
  return request.fsdp, request.expert


def build_mesh(request, devices=None) -> jax.sharding.Mesh:
  """The mesh `request` (its `fsdp` and `expert` sizes) asks for over `devices` (default:
  the host's, as `mesh_devices` picks them)."""
  devices = mesh_devices(request, jax.devices()) if devices is None else list(devices)
  shape = mesh_shape(request, len(devices))
  grid = np.asarray(devices, dtype=object).reshape(shape)
  return jax.sharding.Mesh(grid, AXES)

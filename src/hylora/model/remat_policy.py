"""Remat policies from `MemoryConfig`, over the save points named in `hylora.core.save_points`.

auto: the memory planner's policy, which a run's plan (hylora.plan.run_plan) resolves into
one of the others before the step is built; a model used outside a run (no devices to
plan for) runs it as `full`.
none: save every residual (no rematerialisation); full: recompute everything inside a
scanned layer period from its input; minimal: keep the attention cores' outputs and the
LoRA x@A products, recompute the rest; tiered: keep `hbm_names` in device memory, offload
`host_names` to pinned host memory, recompute the rest (`hylora.plan.remat_planner` picks them).

Host offload needs a backend whose jit programs place buffers in pinned host memory (GPU,
TPU). XLA:CPU lowers the offload's `device_put` to nothing, so on CPU a tiered policy
keeps `host_names` in device memory instead, and says so once (`host_offload="auto"`).
"""

from __future__ import annotations

import warnings

import jax

from hylora.core import save_points
from hylora.core.config import MemoryConfig
from hylora.core.errors import ConfigError

POLICIES = ("auto", "none", "full", "minimal", "tiered")
HOST_OFFLOAD = ("auto", "on", "off")
MINIMAL_NAMES = (save_points.ATTENTION, save_points.LORA_A)
OFFLOAD_BACKENDS = ("gpu", "cuda", "rocm", "tpu")  # pinned_host inside jit works there

_warned: set[str] = set()


def _check_names(field: str, names) -> tuple[str, ...]:
  if isinstance(names, str):
    raise ConfigError(f"memory.{field}: expected a list of save points, got the string {names!r}")
  unknown = [n for n in names if n not in save_points.ALL]
  if unknown:
    raise ConfigError(f"memory.{field}: unknown save points {unknown}; known: {save_points.ALL}")
  return tuple(names)


def check(cfg: MemoryConfig) -> MemoryConfig:
  """Raises ConfigError naming the field when `cfg` is not a usable policy."""
  if cfg.remat not in POLICIES:
    raise ConfigError(f"memory.remat: unknown policy {cfg.remat!r}; choose one of {POLICIES}")
  if cfg.host_offload not in HOST_OFFLOAD:
    raise ConfigError(f"memory.host_offload: must be one of {HOST_OFFLOAD}, "
                      f"got {cfg.host_offload!r}")
  hbm = _check_names("hbm_names", cfg.hbm_names)
  host = _check_names("host_names", cfg.host_names)
  overlap = set(hbm) & set(host)
  if overlap:
    raise ConfigError(f"memory.host_names: {sorted(overlap)} also in memory.hbm_names")
  return cfg


def offloads(cfg: MemoryConfig, backend: str | None = None) -> bool:
  """Whether `host_names` really go to pinned host memory on `backend` (default: JAX's)."""
  if cfg.host_offload == "on":
    return True
  if cfg.host_offload == "off":
    return False
  return (backend or jax.default_backend()) in OFFLOAD_BACKENDS


def tiers(cfg: MemoryConfig, backend: str | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(names kept in device memory, names offloaded to host) as the policy will run."""
  check(cfg)
  if cfg.remat == "none":
    return save_points.ALL, ()
  if cfg.remat in ("full", "auto"):
    return (), ()
  if cfg.remat == "minimal":
    return MINIMAL_NAMES, ()
  if offloads(cfg, backend):
    return tuple(cfg.hbm_names), tuple(cfg.host_names)
  return tuple(cfg.hbm_names) + tuple(cfg.host_names), ()


def remat_policy(cfg: MemoryConfig, backend: str | None = None):
  """The jax.checkpoint policy, or None for "none" (do not wrap in checkpoint)."""
  check(cfg)
  cp = jax.checkpoint_policies
  if cfg.remat == "none":
    return None
  if cfg.remat in ("full", "auto"):
    return cp.nothing_saveable
  hbm, host = tiers(cfg, backend)
  if cfg.remat == "tiered" and cfg.host_names and not host:
    _warn_once(f"memory.host_names {list(cfg.host_names)} stay in device memory: the "
               f"{backend or jax.default_backend()} backend has no pinned host memory inside "
               f"jit (memory.host_offload={cfg.host_offload!r})")
  if not host:
    return cp.save_only_these_names(*hbm)
  return cp.save_and_offload_only_these_names(names_which_can_be_saved=list(hbm),
                                              names_which_can_be_offloaded=list(host),
                                              offload_src="device", offload_dst="pinned_host")


def _warn_once(message: str) -> None:
  if message not in _warned:
    _warned.add(message)
    warnings.warn(message, stacklevel=3)


def wrap(fn, cfg: MemoryConfig):
  """fn under the policy's jax.checkpoint (one layer; see hylora.model.stack).

  prevent_cse stays on: the layers of a period are unrolled inside the scan body (and a
  one-iteration scan is inlined), so without it XLA merges each recomputed forward
  with the original one and keeps every activation, turning `full` into `none`
  (docs/memory.md)."""
  policy = remat_policy(cfg)
  if policy is None:
    return fn
  return jax.checkpoint(fn, policy=policy, prevent_cse=True)

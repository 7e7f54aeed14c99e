"""Remat policies from `MemoryConfig`, over the save points named in `hylora.remat`.

none: save every residual (no rematerialisation); full: recompute everything inside a
layer from its input; minimal: keep the attention cores' outputs and the LoRA x@A
products, recompute the rest; tiered: keep `hbm_names` in device memory, offload
`host_names` to pinned host memory, recompute the rest.
"""

from __future__ import annotations

import jax

from hylora import remat
from hylora.config import MemoryConfig
from hylora.errors import ConfigError

MINIMAL_NAMES = (remat.ATTENTION, remat.LORA_A)


def _check_names(field: str, names) -> tuple[str, ...]:
  unknown = [n for n in names if n not in remat.ALL]
  if unknown:
    raise ConfigError(f"memory.{field}: unknown save points {unknown}; known: {remat.ALL}")
  return tuple(names)


def remat_policy(cfg: MemoryConfig):
  """The jax.checkpoint policy, or None for "none" (do not wrap in checkpoint)."""
  cp = jax.checkpoint_policies
  if cfg.remat == "none":
    return None
  if cfg.remat == "full":
    return cp.nothing_saveable
  if cfg.remat == "minimal":
    return cp.save_only_these_names(*MINIMAL_NAMES)
  if cfg.remat == "tiered":
    hbm = _check_names("hbm_names", cfg.hbm_names)
    host = _check_names("host_names", cfg.host_names)
    overlap = set(hbm) & set(host)
    if overlap:
      raise ConfigError(f"memory.host_names: {sorted(overlap)} also in memory.hbm_names")
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=list(hbm), names_which_can_be_offloaded=list(host),
        offload_src="device", offload_dst="pinned_host")
  raise ConfigError(f"memory.remat: unknown policy {cfg.remat!r}")


def wrap(fn, cfg: MemoryConfig):
  policy = remat_policy(cfg)
  if policy is None:
    return fn
  return jax.checkpoint(fn, policy=policy, prevent_cse=False)

"""Per-layer auxiliary outputs: one fixed schema so scanned layers stack them."""

from __future__ import annotations

import jax.numpy as jnp

from hylora.core.config import ModelConfig


def empty_aux(cfg: ModelConfig) -> dict:
  return {
      "moe_aux_loss": jnp.zeros((), jnp.float32),  # load-balance loss (unweighted)
      "moe_z_loss": jnp.zeros((), jnp.float32),  # router z-loss (unweighted)
      "indexer_kl": jnp.zeros((), jnp.float32),  # indexer KL (unweighted)
      "expert_load": jnp.zeros((cfg.moe.experts,), jnp.float32),  # tokens routed per expert
      "dropped_tokens": jnp.zeros((), jnp.float32),  # token-expert pairs dropped
      # expert-parallel all-to-all rounds of the layer's busiest chunk (0: no all-to-all)
      "all_to_all_rounds": jnp.zeros((), jnp.float32),
  }


def merge_aux(cfg: ModelConfig, *parts: dict) -> dict:
  out = empty_aux(cfg)
  for part in parts:
    for key, value in part.items():
      if key not in out:
        raise KeyError(f"unknown aux output {key!r}; extend hylora.model.aux.empty_aux")
      out[key] = out[key] + value
  return out

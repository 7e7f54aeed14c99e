"""Load balancing for a frozen router (docs/moe.md).

* Metrics: per-rank load under a placement, and the busiest-rank / mean ratio that
  decides how long the expert-parallel step waits for its slowest device.
* Placement planner (DeepSeek EPLB style): from the per-expert load measured over a
  window, replicate the hottest experts into the spare slots (each copy then serves an
  equal share of its expert's tokens) and pack the copies onto ranks heaviest first,
  each onto the least-loaded rank with a free slot. Apply the plan with
  `placement.relocate_module` on the frozen, LoRA and optimizer-moment subtrees.
* Aux-loss-free balancing for runs that train the router: the per-expert selection
  bias (router.RouterBias) is nudged toward the mean load after each step, outside the
  optimizer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def slot_loads(expert_load: jax.Array, slot_to_expert: jax.Array) -> jax.Array:
  """[E] routed pairs per expert -> [slots] per slot (copies share their expert's load)."""
  copies = jnp.bincount(slot_to_expert, length=expert_load.shape[-1])
  return expert_load[slot_to_expert] / copies[slot_to_expert]


def rank_loads(expert_load: jax.Array, slot_to_expert: jax.Array, ranks: int) -> jax.Array:
  """[E] per-expert load -> [ranks] load of each expert-parallel rank."""
  return slot_loads(expert_load, slot_to_expert).reshape(ranks, -1).sum(axis=-1)


def busiest_over_mean(loads: jax.Array) -> jax.Array:
  """max / mean over the last axis (1.0 = perfectly balanced)."""
  return jnp.max(loads, axis=-1) / jnp.maximum(jnp.mean(loads, axis=-1), 1e-9)


def load_metrics(expert_load: jax.Array, slot_to_expert: jax.Array, ranks: int) -> dict:
  ranked = rank_loads(expert_load, slot_to_expert, ranks)
  return {
      "rank_load": ranked,
      "rank_max_over_mean": busiest_over_mean(ranked),
      "expert_max_over_mean": busiest_over_mean(expert_load)
  }


def plan_placement(load_window, ranks: int, slots_per_rank: int) -> np.ndarray:
  """Per-expert load ([E] or a window [W, E], summed) -> slot_to_expert [ranks * slots_per_rank].

  Spare slots (ranks * slots_per_rank - E) each take one more copy of the expert with the
  highest load per copy; copies are then packed heaviest first onto the least-loaded rank
  that has a free slot and no copy of that expert yet (when one exists)."""
  load = np.asarray(load_window, np.float64)
  load = load.sum(axis=0) if load.ndim == 2 else load
  experts, slots = load.shape[0], ranks * slots_per_rank
  if slots < experts:
    raise ValueError(f"plan_placement: {ranks} ranks x {slots_per_rank} slots cannot hold "
                     f"{experts} experts")
  copies = np.ones(experts, np.int64)
  for _ in range(slots - experts):
    copies[np.argmax(load / copies)] += 1
  items = [(load[e] / copies[e], e) for e in range(experts) for _ in range(copies[e])]
  items.sort(key=lambda item: (-item[0], item[1]))
  rank_load = np.zeros(ranks)
  members: list[list[int]] = [[] for _ in range(ranks)]
  for share, expert in items:
    free = [r for r in range(ranks) if len(members[r]) < slots_per_rank]
    fresh = [r for r in free if expert not in members[r]] or free
    r = min(fresh, key=lambda r: (rank_load[r], r))
    members[r].append(expert)
    rank_load[r] += share
  return np.asarray([e for m in members for e in sorted(m)], np.int32)


def update_router_bias(bias: jax.Array, expert_load: jax.Array, rate: float) -> jax.Array:
  """DeepSeek-V3 aux-loss-free step: b_e += rate * sign(mean load - load_e) (per layer;
  leading axes broadcast). Applied to the frozen RouterBias after the optimizer update."""
  mean = jnp.mean(expert_load, axis=-1, keepdims=True)
  return bias + rate * jnp.sign(mean - expert_load).astype(bias.dtype)

"""Where each routed expert lives.

The routed-expert arrays (base weights, LoRA factors and their optimizer moments) are
stored by physical *slot*: slot s sits on expert-parallel rank s // (slots / ranks).
`slot_to_expert [slots]` says which logical expert (the router's column) each slot holds.
The identity table is the initial layout; a re-placement permutes experts across ranks,
and with more slots than experts the extra slots hold replicas of hot experts.

The router keeps speaking logical experts; `route_to_slots` turns each (token, expert)
choice into a slot, spreading a replicated expert's tokens over its copies by token
index. `relocate` moves stored rows from one table to another, so a re-placement never
changes what the layer computes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

# Leaves of a MoE module's pure-dict subtree that carry the slot axis first.
SLOT_LEAVES = ("gate_up", "down", "lora_a", "lora_b")


class ExpertPlacement(nnx.Variable):
  """slot_to_expert [slots] int32; frozen, changed only by a re-placement."""


def initial_placement(num_experts: int, slots: int) -> jax.Array:
  """Slot s holds expert s mod E: every expert once, spare slots copy experts 0, 1, ...
  (a fixed rule, so checkpoint readers know which expert a spare slot starts with)."""
  return jnp.arange(slots, dtype=jnp.int32) % num_experts


def _slots_by_expert(slot_to_expert: jax.Array, num_experts: int):
  """(slots sorted by expert, copies [E], first index of each expert in that order)."""
  order = jnp.argsort(slot_to_expert, stable=True).astype(jnp.int32)
  copies = jnp.bincount(slot_to_expert, length=num_experts).astype(jnp.int32)
  first = jnp.cumsum(copies) - copies
  return order, copies, first


def route_to_slots(experts: jax.Array, slot_to_expert: jax.Array, num_experts: int):
  """experts [..., k] logical ids -> slots [..., k]; token n (its flat index) uses copy
  (n mod copies)."""
  order, copies, first = _slots_by_expert(slot_to_expert, num_experts)
  lead = experts.shape[:-1]
  token = jnp.arange(math.prod(lead), dtype=jnp.int32).reshape(*lead, 1)
  pick = first[experts] + token % jnp.maximum(copies[experts], 1)
  return order[pick]


def relocate(array: jax.Array, old: jax.Array, new: jax.Array, num_experts: int) -> jax.Array:
  """Rows of `array` [slots_old, ...] stored under table `old`, re-stored under `new`
  ([slots_new, ...]); a replica takes the row of the expert's first old copy."""
  order, _, first = _slots_by_expert(old, num_experts)
  return jnp.take(array, order[first[new]], axis=0)


def relocate_module(tree: dict, new: jax.Array, num_experts: int, old: jax.Array) -> dict:
  """A MoE module's pure-dict subtree (frozen, LoRA or an optimizer moment of it; one
  layer, or stacked layers with matching leading axes on `old`/`new`) re-stored under
  `new`. Per-expert leaves move; a shared LoRA A (no slot axis) and the rest stay."""
  if old.ndim > 1:  # stacked layers: one table per layer
    return jax.vmap(lambda t, n, o: relocate_module(t, n, num_experts, o))(tree, new, old)

  def visit(node, path):
    if isinstance(node, dict):
      return {k: visit(v, path + (k,)) for k, v in node.items()}
    name = path[-1] if path else None
    if name == "placement":
      return new.astype(node.dtype)
    if ("experts" in path and name in SLOT_LEAVES and hasattr(node, "shape") and node.ndim == 3 and
        node.shape[0] == old.shape[0]):
      return relocate(node, old, new, num_experts)
    return node

  return visit(tree, ())


def logical_rows(array: jax.Array, slot_to_expert: jax.Array, num_experts: int) -> jax.Array:
  """Per-slot rows [slots, ...] summed into per-expert rows [E, ...] (e.g. the gradient
  of a replicated expert is the sum over its copies)."""
  return jax.ops.segment_sum(array, slot_to_expert, num_segments=num_experts)


def tie_replica_grads(grads: jax.Array, slot_to_expert: jax.Array, num_experts: int):
  """Training with replicas: each expert's gradient summed over its copies goes to its
  first copy, the other copies get zero (so global-norm clipping counts it once).
  Call `refresh_replicas` after the optimizer update to copy first copies over."""
  order, copies, first = _slots_by_expert(slot_to_expert, num_experts)
  primary = order[first[slot_to_expert]]
  is_primary = primary == jnp.arange(slot_to_expert.shape[0])
  total = logical_rows(grads, slot_to_expert, num_experts)[slot_to_expert]
  mask = is_primary.reshape((-1,) + (1,) * (grads.ndim - 1))
  return jnp.where(mask, total, jnp.zeros_like(total))


def refresh_replicas(rows: jax.Array, slot_to_expert: jax.Array, num_experts: int):
  """Every copy of an expert takes its first copy's row."""
  return relocate(rows, slot_to_expert, slot_to_expert, num_experts)

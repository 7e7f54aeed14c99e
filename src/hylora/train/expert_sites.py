"""The MoE layers of the model's pytrees and their per-slot leaves.

A *site* is the pure-dict path of one MoE module (`.../ffn`) inside the stacked layers:
its `placement` table is `[repeats, slots]` and its routed-expert leaves (base weights,
LoRA factors, and any optimizer moment of them) are `[repeats, slots, ...]`. The helpers
here find those leaves in any tree that mirrors the parameters (the frozen and LoRA
pure dicts, an optax state whose moments are such dicts) and move, tie or refresh them
under the placement tables (hylora.model.ffn.placement), inside or outside jit.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from hylora.core.config import Config
from hylora.model.ffn import placement as pl
from hylora.core.architecture import stacked_layers, stacked_position

PLACEMENT = "placement"
LORA_LEAVES = ("lora_a", "lora_b")


@dataclasses.dataclass(frozen=True)
class Site:
  path: tuple  # pure-dict path of the MoE module
  layers: tuple[int, ...]  # global layer index of each entry of the stacked axis


PACKED_ARRAYS = ("codes", "scales")


def _keys(path) -> tuple:
  """A leaf's keys; the arrays of a packed weight (codes, scales) answer to its name."""
  keys = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
  return keys[:-1] if keys and keys[-1] in PACKED_ARRAYS else keys


def find_sites(cfg: Config, frozen) -> list[Site]:
  """Every MoE module of the frozen tree (arrays or ShapeDtypeStructs), in layer order."""
  sites = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(frozen)[0]:
    keys = _keys(path)
    stacked = stacked_position(keys)
    if keys[-1] != PLACEMENT or stacked is None:
      continue
    segment, position, _ = stacked
    sites.append(Site(keys[:-1], stacked_layers(cfg.model, segment, position)))
  return sorted(sites, key=lambda s: s.layers)


def tables(frozen, sites: list[Site]) -> dict[tuple, jax.Array]:
  """site path -> its placement table [repeats, slots], read from the frozen tree."""
  out = {}
  for site in sites:
    node = frozen
    for key in site.path + (PLACEMENT,):
      node = node[key]
    out[site.path] = node
  return out


def _site_of(keys: tuple, sites: dict) -> tuple | None:
  """The site whose path the leaf's key path ends in (before `experts/<name>` or
  `placement`); optimizer states put their own keys before the parameter path."""
  if keys and keys[-1] == PLACEMENT:
    stem = keys[:-1]
  elif len(keys) >= 2 and keys[-2] == "experts" and keys[-1] in pl.SLOT_LEAVES:
    stem = keys[:-2]
  else:
    return None
  for site in sites:
    if stem[len(stem) - len(site):] == site:
      return site
  return None


def map_slot_leaves(tree, tables_: dict, fn: Callable, *, names=pl.SLOT_LEAVES):
  """Applies fn(leaf [slots, ...], table [slots]) per stacked layer to every per-slot
  leaf named in `names` under a site of `tables_`; other leaves pass through."""

  def visit(path, leaf):
    keys = _keys(path)
    site = _site_of(keys, tables_)
    # A shared LoRA A ([repeats, d, r]) has no slot axis: only 4-D leaves are per slot.
    if site is None or keys[-1] not in names or getattr(leaf, "ndim", 0) != 4:
      return leaf
    return jax.vmap(fn)(leaf, tables_[site])

  return jax.tree_util.tree_map_with_path(visit, tree)


def relocate(tree, old: dict, new: dict, num_experts: int):
  """The tree re-stored under the `new` tables: per-slot leaves move (a new copy takes
  the row of its expert's first old slot) and placement leaves become the new tables."""

  def visit(path, leaf):
    keys = _keys(path)
    site = _site_of(keys, old)
    if site is None:
      return leaf
    if keys[-1] == PLACEMENT:
      return new[site].astype(leaf.dtype)
    if getattr(leaf, "ndim", 0) != 4:
      return leaf
    return jax.vmap(lambda a, o, n: pl.relocate(a, o, n, num_experts))(leaf, old[site], new[site])

  return jax.tree_util.tree_map_with_path(visit, tree)


def tie_replica_grads(grads, tables_: dict, num_experts: int):
  """LoRA gradients of replicated experts summed into each expert's first slot (zero in
  the other copies), so the optimizer sees every expert once."""
  return map_slot_leaves(grads, tables_, lambda g, t: pl.tie_replica_grads(g, t, num_experts),
                         names=LORA_LEAVES)


def refresh_replicas(lora, tables_: dict, num_experts: int):
  """Every copy of an expert's LoRA factors takes its first slot's values."""
  return map_slot_leaves(lora, tables_, lambda a, t: pl.refresh_replicas(a, t, num_experts),
                         names=LORA_LEAVES)

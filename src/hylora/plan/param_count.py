"""Parameter counts by kind, read from the model's own (abstract) parameter trees.

Nothing here is a formula of the architecture: every figure is the sum of the shapes
that `HybridLM` actually builds, each classified by the kind the architecture's
description (`hylora.core.architecture`) gives its tensor.

Kinds: routed `experts`, `expert_latent` (the latent MoE's projections), `shared_experts`, `dense_ffn` (the first dense layers),
`attention` (every mixer projection, gate and indexer), `router` (kernel and the
selection bias), `norms` (RMSNorm scales, per-head norms), `embeddings` (the input
table and the LM head), `vision` (the frozen image encoder and its projector), and
`other` (anything a new structure adds until it is named here). Integer arrays (the
expert placement table) are bookkeeping, not parameters: they are not counted.

Active parameters per token: every parameter a token's forward pass multiplies by,
i.e. all non-routed parameters, plus the `top_k / experts` share of the routed experts;
the input embedding table is excluded (a token reads one row of it, it multiplies
by none of it), and so is the vision tower (it runs once per image tile, not per token). LoRA factors are counted separately (`lora`) and never in `total`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from hylora.core.architecture import PARAMETER_KINDS, parameter_kind
from hylora.core.config import Config
from hylora.quant import is_packed

KINDS = PARAMETER_KINDS

# The input embedding table: excluded from the active count (a row lookup).
INPUT_EMBEDDING = ("embed",)


def path_keys(path) -> tuple[str, ...]:
  """A tree path (from tree_flatten_with_path) as a tuple of plain strings."""
  keys = []
  for entry in path:
    key = getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", entry)))
    keys.append(str(key))
  return tuple(keys)


def active_share(cfg: Config, keys: tuple[str, ...]) -> float:
  """The fraction of this array that one token's forward pass uses."""
  if keys == INPUT_EMBEDDING or parameter_kind(keys) == "vision":
    return 0.0
  if parameter_kind(keys) == "experts":
    return cfg.model.moe.top_k / cfg.model.moe.experts
  return 1.0


def is_parameter(leaf) -> bool:
  return is_packed(leaf) or bool(jnp.issubdtype(leaf.dtype, jnp.floating))


def leaves(tree) -> list[tuple[tuple[str, ...], object]]:
  """(keys, leaf) for every array of a pure-dict pytree, in tree order; a packed
  weight (hylora.quant) is one leaf, of its bf16 kernel's shape."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_packed)
  return [(path_keys(path), leaf) for path, leaf in flat]


def count_params(cfg: Config, lora_tree, frozen_tree) -> dict:
  """{"total", "active", "lora", "by_kind": {kind: {"total", "active", "lora"}}}.

  Trees hold anything with a `.shape` (ShapeDtypeStructs are enough)."""
  by_kind = {k: {"total": 0, "active": 0, "lora": 0} for k in KINDS}
  for keys, leaf in leaves(frozen_tree):
    if not is_parameter(leaf):
      continue
    n = math.prod(leaf.shape)
    kind = by_kind[parameter_kind(keys)]
    kind["total"] += n
    kind["active"] += round(n * active_share(cfg, keys))
  for keys, leaf in leaves(lora_tree):
    by_kind[parameter_kind(keys)]["lora"] += math.prod(leaf.shape)
  by_kind = {k: v for k, v in by_kind.items() if any(v.values())}
  return {
      "total": sum(v["total"] for v in by_kind.values()),
      "active": sum(v["active"] for v in by_kind.values()),
      "lora": sum(v["lora"] for v in by_kind.values()),
      "by_kind": by_kind
  }

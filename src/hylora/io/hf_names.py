"""The mapping between the model's parameters and the tensor names of a Hugging Face-layout
checkpoint (safetensors), expanded over a config. The names are the checkpoint family's
table (`hylora.io.name_maps`, chosen by `model.family`); the layouts are part of the
architecture's description (`hylora.core.architecture`).

Model parameters are leaves of the pure-dict pytrees of `hylora.train.state` (paths
joined with "/"). Decoder-layer leaves live under
`stack/segments/<s>/periods/layers/<i>/...` with a leading `layers` axis (the scanned
repeats of a segment, hylora.model.stack); routed-expert leaves then carry the expert
axis. In the checkpoint every layer and every expert is a tensor of its own:
`<layer prefix with the global layer>.<name>`, with `<e>` the expert index. The model stores
experts by slot (hylora.model.ffn.placement): on loading, slot s takes expert s mod E
(the initial placement); on writing, each expert comes from its first slot.

Layouts: see `hylora.core.architecture.Tensor`.

A frozen linear kept packed (`hylora.quant.PackedWeight`, as `model.quantization` says)
is one leaf too: its shape is the bf16 kernel's, its `packed` format says which tensors
stand for each checkpoint name (`hylora.io.packed_tensors`). `packed_formats` says which
leaves a checkpoint's quantization packs: linears of the packable kinds whose checkpoint
modules `model.quantization.ignore` does not name.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterator

import jax
import jax.numpy as jnp

from hylora.core.architecture import (ALL_LAYER_TENSORS, MODEL_TENSORS, Tensor, stacked_layers,
                                      stacked_position)
from hylora.core.config import Config
from hylora.core.errors import ConfigError
from hylora.io.name_maps import NameMap, name_map
from hylora.io.packed_tensors import module
from hylora.quant.packed_weight import is_packed
from pallas_kernels.quantized_matmul import formats

# The vision tower keeps its own layout (house family): `vision/<path>` is
# `<vision_prefix><path>` with "/" read as "."; its stacked encoder blocks are split into
# `blocks.<i>`.
VISION_ROOT = "vision/"
VISION_STACK = "vision/encoder/blocks/"


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One model leaf and the checkpoint tensors that make it up."""

  path: tuple  # pure-dict key path
  tensor: Tensor  # what the architecture's description says of it
  shape: tuple[int, ...]
  dtype: object
  layers: tuple[int, ...] | None  # global layer index of each entry of the stacked axis
  name_template: tuple[str, ...]  # full names with "{layer}" / "{e}" placeholders
  experts: int = 0  # size of the expert (slot) axis (per-expert rules)
  routed: int = 0  # routed experts of the model: slot s starts as expert s mod routed
  disk: str = ""  # the disk layout (the architecture's, or the name map's override)
  packed: str | None = None  # the packed format of a PackedWeight leaf (None: plain array)

  @property
  def key(self) -> str:
    return "/".join(map(str, self.path))

  @property
  def stack_dims(self) -> int:
    return (self.layers is not None) + (self.experts > 0)

  @property
  def item_shape(self) -> tuple[int, ...]:
    """The shape of one layer's (one expert's) slice in the model's layout."""
    return self.shape[self.stack_dims:]

  def items(self) -> Iterator[tuple[tuple[int, ...], tuple[str, ...]]]:
    """(stack index, checkpoint names) for every layer / expert slice of the leaf."""
    repeats = range(len(self.layers)) if self.layers is not None else [None]
    experts = range(self.routed) if self.experts else [None]  # each expert once
    for r in repeats:
      for e in experts:
        index = tuple(i for i in (r, e) if i is not None)
        yield index, self.names_at(index)

  def names_at(self, index: tuple[int, ...]) -> tuple[str, ...]:
    fill = {}
    if self.layers is not None:
      fill["layer"] = self.layers[index[0]]
    if self.experts:
      fill["e"] = index[-1] % self.routed
    return tuple(t.format(**fill) for t in self.name_template)

  def tensor_shape(self) -> tuple[int, ...]:
    """The shape each checkpoint tensor of one slice must have."""
    item, rule = self.item_shape, self.tensor
    if not rule.linear:
      return dataclasses.replace(rule, disk=self.disk).disk_shape(item)
    n_in = math.prod(item[:rule.in_dims])
    n_out = math.prod(item[rule.in_dims:])
    return (n_out // len(self.name_template), n_in)


_LAYER = {t.path: t for t in ALL_LAYER_TENSORS}
_MODEL = {t.path: t for t in MODEL_TENSORS}


def plan(cfg: Config, tree: dict) -> list[Leaf]:
  """A `Leaf` for every leaf of a pure-dict tree of arrays / ShapeDtypeStructs, a
  `PackedWeight` counting as one leaf."""
  names = name_map(cfg.model.family)
  leaves = []
  for key_path, value in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_packed)[0]:
    path = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in key_path)
    if is_packed(value):
      leaf = _leaf(cfg, names, path, tuple(value.shape), jnp.bfloat16)
      leaves.append(_packed(dataclasses.replace(leaf, packed=value.format)))
    else:
      leaves.append(_leaf(cfg, names, path, tuple(value.shape), value.dtype))
  return leaves


def _packed(leaf: Leaf) -> Leaf:
  """A packed leaf, checked: a linear, whose fused parts each own whole scale blocks."""
  if not leaf.tensor.linear:
    raise ConfigError(f"model parameter {leaf.key}: packed ({leaf.packed}) but not a linear; "
                      "only linear weights can stay packed")
  rows = formats.get(leaf.packed).block[0]
  out = leaf.tensor_shape()[0]
  if len(leaf.name_template) > 1 and out % rows:
    raise ConfigError(f"model parameter {leaf.key}: {leaf.packed} fuses "
                      f"{len(leaf.name_template)} checkpoint linears of {out} outputs each, "
                      f"not a multiple of its {rows}-row scale blocks")
  return leaf


# Parameter kinds whose linears a checkpoint may ship packed: never the router, the
# embeddings / lm_head or the vision tower.
PACKABLE_KINDS = ("attention", "dense_ffn", "shared_experts", "experts", "expert_latent")


def ignored_module(name: str, ignore) -> bool:
  """compressed-tensors' rule: an entry names the module exactly, or is "re:REGEX"
  matched from the start of the module name."""
  return any(re.match(e[3:], name) if e.startswith("re:") else name == e for e in ignore)


def packed_formats(cfg: Config, tree: dict) -> dict[tuple, str]:
  """path -> packed format, for the leaves of a bf16 tree (arrays / ShapeDtypeStructs)
  that `model.quantization` packs."""
  q = cfg.model.quantization
  if q.format == "none":
    return {}
  out = {}
  for leaf in plan(cfg, tree):
    if not leaf.tensor.linear or leaf.tensor.kind not in PACKABLE_KINDS or not leaf.name_template:
      continue
    modules = [module(n) for _, names in leaf.items() for n in names]
    kept = [m for m in modules if ignored_module(m, q.ignore)]
    if len(kept) == len(modules):
      continue
    if kept:
      packed = next(m for m in modules if m not in kept)
      raise ConfigError(f"model parameter {leaf.key}: model.quantization.ignore keeps "
                        f"{kept[0]!r} in bf16 but packs {packed!r}; one parameter is packed "
                        "whole or not at all")
    out_n, in_k = leaf.tensor_shape()
    reason = formats.get(q.format).check_matrix(out_n, in_k)
    if reason:
      raise ConfigError(f"model parameter {leaf.key} ({modules[0]}): {reason}")
    _packed(dataclasses.replace(leaf, packed=q.format))
    out[leaf.path] = q.format
  return out


def _missing(names: NameMap, joined: str, where: str) -> ConfigError:
  return ConfigError(f"model parameter {joined}: the {names.family} checkpoint layout has no "
                     f"name for {where!r} ({names.source}); this model does not fit that "
                     "family's checkpoints")


def _leaf(cfg: Config, names: NameMap, path: tuple, shape, dtype) -> Leaf:
  joined = "/".join(map(str, path))
  stacked = stacked_position(path)
  if stacked is not None:
    segment, position, rel = stacked
    rule = _LAYER.get(rel)
    if rule is None:
      raise ConfigError(f"model parameter {joined}: not in the architecture's description "
                        "(hylora.core.architecture); add the tensor to its block")
    if rule.fill:
      entry_names, disk = (), ""
    elif rel in names.layer:
      entry = names.layer[rel]
      entry_names, disk = entry.names, entry.disk if entry.disk is not None else rule.disk
    else:
      raise _missing(names, joined, rel)
    layers = stacked_layers(cfg.model, segment, position)
    if len(layers) != shape[0]:
      raise ConfigError(f"model parameter {joined}: {shape[0]} stacked layers, the layer "
                        f"plan has {len(layers)}")
    experts = shape[1] if rule.per_expert else 0
    template = tuple(names.layer_prefix + n for n in entry_names)
    return Leaf(path, rule, shape, dtype, layers, template, experts, cfg.model.moe.experts, disk)
  if joined in _MODEL:
    if joined not in names.model:
      raise _missing(names, joined, joined)
    entry, rule = names.model[joined], _MODEL[joined]
    disk = entry.disk if entry.disk is not None else rule.disk
    return Leaf(path, rule, shape, dtype, None, entry.names, disk=disk)
  if joined.startswith(VISION_ROOT) and names.vision_prefix:
    prefix = names.vision_prefix
    rest = joined[len(VISION_ROOT):].replace("/", ".")
    adapter = joined.rsplit("/", 1)[0] if joined.endswith("/kernel") else None
    rule = Tensor(joined, "vision", adapter=adapter)
    if joined.startswith(VISION_STACK):
      tail = joined[len(VISION_STACK):].replace("/", ".")
      stem = VISION_STACK[len(VISION_ROOT):].replace("/", ".")
      name = f"{prefix}{stem}{{layer}}.{tail}"
      return Leaf(path, rule, shape, dtype, tuple(range(shape[0])), (name,))
    return Leaf(path, rule, shape, dtype, None, (prefix + rest,))
  raise _missing(names, joined, joined)

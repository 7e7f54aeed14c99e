"""The mapping between the model's parameters and the tensor names of a Hugging Face-layout
checkpoint (safetensors), expanded over a config. The names and layouts themselves are
part of the architecture's description (`hylora.core.architecture`).

Model parameters are leaves of the pure-dict pytrees of `hylora.train.state` (paths
joined with "/"). Decoder-layer leaves live under
`stack/segments/<s>/periods/layers/<i>/...` with a leading `layers` axis (the scanned
repeats of a segment, hylora.model.stack); routed-expert leaves then carry the expert
axis. In the checkpoint every layer and every expert is a tensor of its own:
`model.layers.<global layer>.<name>`, with `<e>` the expert index. The model stores
experts by slot (hylora.model.ffn.placement): on loading, slot s takes expert s mod E
(the initial placement); on writing, each expert comes from its first slot.

Layouts: see `hylora.core.architecture.Tensor`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import jax

from hylora.core.architecture import (ALL_LAYER_TENSORS, MODEL_TENSORS, Tensor, stacked_layers,
                                      stacked_position)
from hylora.core.config import Config
from hylora.core.errors import ConfigError

LAYER_PREFIX = "model.layers.{layer}."

# The vision tower keeps its own layout: `vision/<path>` is `vision_tower.<path>` with "/"
# read as "."; its stacked encoder blocks are split into `blocks.<i>`.
VISION_PREFIX = ("vision/", "vision_tower.")
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
      return item
    n_in = math.prod(item[:rule.in_dims])
    n_out = math.prod(item[rule.in_dims:])
    return (n_out // len(rule.names), n_in)


def _by_path(tensors) -> dict[str, Tensor]:
  return {t.path: t for t in tensors}


_LAYER = _by_path(ALL_LAYER_TENSORS)
_MODEL = _by_path(MODEL_TENSORS)


def plan(cfg: Config, tree: dict) -> list[Leaf]:
  """A `Leaf` for every leaf of a pure-dict tree of arrays / ShapeDtypeStructs."""
  leaves = []
  for key_path, value in jax.tree_util.tree_flatten_with_path(tree)[0]:
    path = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in key_path)
    leaves.append(_leaf(cfg, path, tuple(value.shape), value.dtype))
  return leaves


def _leaf(cfg: Config, path: tuple, shape, dtype) -> Leaf:
  joined = "/".join(map(str, path))
  stacked = stacked_position(path)
  if stacked is not None:
    segment, position, rel = stacked
    rule = _LAYER.get(rel)
    if rule is None:
      raise ConfigError(f"model parameter {joined}: no checkpoint name in the architecture's "
                        "description (hylora.core.architecture); add the tensor to its block")
    layers = stacked_layers(cfg.model, segment, position)
    if len(layers) != shape[0]:
      raise ConfigError(f"model parameter {joined}: {shape[0]} stacked layers, the layer "
                        f"plan has {len(layers)}")
    experts = shape[1] if rule.per_expert else 0
    names = tuple(LAYER_PREFIX + n for n in rule.names)
    return Leaf(path, rule, shape, dtype, layers, names, experts, cfg.model.moe.experts)
  if joined in _MODEL:
    return Leaf(path, _MODEL[joined], shape, dtype, None, _MODEL[joined].names)
  if joined.startswith(VISION_PREFIX[0]):
    rest = joined[len(VISION_PREFIX[0]):].replace("/", ".")
    adapter = joined.rsplit("/", 1)[0] if joined.endswith("/kernel") else None
    rule = Tensor(joined, "vision", (VISION_PREFIX[1] + rest,), adapter=adapter)
    if joined.startswith(VISION_STACK):
      tail = joined[len(VISION_STACK):].replace("/", ".")
      stem = VISION_STACK[len(VISION_PREFIX[0]):].replace("/", ".")
      name = f"{VISION_PREFIX[1]}{stem}{{layer}}.{tail}"
      return Leaf(path, rule, shape, dtype, tuple(range(shape[0])), (name,))
    return Leaf(path, rule, shape, dtype, None, rule.names)
  raise ConfigError(f"model parameter {joined}: no checkpoint name in the architecture's "
                    "description (hylora.core.architecture.MODEL_TENSORS); add one")

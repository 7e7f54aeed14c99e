"""The op registry: every op that has (or will have) a fast kernel is one entry here.

An op has one reference implementation (plain JAX, the ground truth that tests and
`experiments.check_ops` compare against) and any number of fast implementations, each
declared for the backends it runs on. The model never branches on the backend itself:
it asks `resolve(op, choice)` and gets a callable with the reference's signature.

Implementations are named by import path ("package.module:function") and imported
lazily, so registering a GPU kernel costs nothing on a CPU-only machine.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import jax

AUTO = "auto"
REFERENCE = "reference"

PER_SHARD_MODES = ("rows", "rows_whole_weight", "linear_recurrence", "sparse_attention", "indexer",
                   "tokens", "causal_conv")


def per_shard_mode(per_shard: bool | str) -> str | None:
  """How an implementation runs per device (None: XLA partitions it)."""
  if per_shard is False:
    return None
  mode = "rows" if per_shard is True else per_shard
  if mode not in PER_SHARD_MODES:
    raise ValueError(f"per_shard: {per_shard!r}; choose True/False or one of {PER_SHARD_MODES}")
  return mode


def _per_shard_wrappers() -> dict[str, Callable]:
  from meshes.per_shard import (split_over_batch, split_rows_whole_weight,
                                split_tokens_whole_weights)
  from meshes import gathered_keys, split_conv, split_recurrence
  return {
      "rows": split_over_batch,
      "rows_whole_weight": split_rows_whole_weight,
      "linear_recurrence": split_recurrence.split_recurrence_over_devices,
      "sparse_attention": gathered_keys.sparse_attention_over_devices,
      "indexer": gathered_keys.indexer_over_devices,
      "tokens": split_tokens_whole_weights,
      "causal_conv": split_conv.causal_conv_over_devices
  }


@dataclasses.dataclass(frozen=True)
class Impl:
  """One implementation of an op."""

  name: str
  target: str | Callable[..., Any]  # "module:function" or the callable itself
  backends: tuple[str, ...]  # where "auto" may pick it: subset of {"cpu", "gpu", "tpu"}
  priority: int = 0  # among auto candidates, the highest wins
  # A kernel XLA cannot partition (one custom call) runs per device under a mesh:
  # "rows" (or True) acts on each batch row alone (meshes.per_shard.split_over_batch),
  # "rows_whole_weight" too, with its second argument (a weight) whole on every device;
  # where the sequence is split over devices too (meshes.split_recurrence,
  # meshes.gathered_keys),
  # "linear_recurrence" passes its state between the devices' token ranges and
  # "sparse_attention" / "indexer" gather the keys for each device's range of queries;
  # "tokens" acts on each token alone, its weights whole on every device;
  # "causal_conv" is a short causal convolution, "rows_whole_weight" but where the sequence
  # is split, each device's range with the previous range's last tokens (meshes.split_conv).
  per_shard: bool | str = False

  def load(self) -> Callable[..., Any]:
    if callable(self.target):
      fn = self.target
    else:
      module, _, attr = self.target.partition(":")
      fn = getattr(importlib.import_module(module), attr)
    if self.per_shard:
      return _per_shard_wrappers()[per_shard_mode(self.per_shard)](fn)
    return fn


@dataclasses.dataclass
class OpEntry:
  name: str
  reference: Impl
  impls: dict[str, Impl] = dataclasses.field(default_factory=dict)


class OpRegistry:
  """Maps op name -> reference + fast implementations."""

  def __init__(self):
    self._ops: dict[str, OpEntry] = {}

  def define(self, name: str, reference) -> OpEntry:
    if name in self._ops:
      raise ValueError(f"op {name!r} is already defined")
    entry = OpEntry(name, Impl(REFERENCE, reference, ("cpu", "gpu", "tpu"), priority=-1))
    self._ops[name] = entry
    return entry

  def register(self, op: str, name: str, target, *, backends=("gpu",), priority: int = 0,
               per_shard: bool | str = False):
    per_shard_mode(per_shard)
    entry = self.entry(op)
    if name in (REFERENCE, AUTO):
      raise ValueError(f"implementation name {name!r} is reserved")
    entry.impls[name] = Impl(name, target, tuple(backends), priority, per_shard)

  def entry(self, op: str) -> OpEntry:
    if op not in self._ops:
      raise KeyError(f"unknown op {op!r}; known ops: {sorted(self._ops)}")
    return self._ops[op]

  def names(self) -> list[str]:
    return sorted(self._ops)

  def choices(self, op: str) -> list[str]:
    return [AUTO, REFERENCE, *sorted(self.entry(op).impls)]

  def pick(self, op: str, choice: str = AUTO, backend: str | None = None) -> Impl:
    """The implementation that `choice` names ("auto" = best for the backend)."""
    entry = self.entry(op)
    if choice == REFERENCE:
      return entry.reference
    if choice != AUTO:
      if choice not in entry.impls:
        raise ValueError(f"op {op!r} has no implementation {choice!r}; "
                         f"choose one of {self.choices(op)}")
      return entry.impls[choice]
    backend = backend or jax.default_backend()
    candidates = [i for i in entry.impls.values() if backend in i.backends]
    # The reference (priority -1) competes too: an impl registered below it is only
    # ever used when asked for by name.
    return max([entry.reference, *candidates], key=lambda i: i.priority)

  def resolve(self, op: str, choice: str = AUTO, backend: str | None = None):
    return self.pick(op, choice, backend).load()

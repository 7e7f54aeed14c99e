"""Which frozen linears a quantized checkpoint packs, and the model's parameter tree
with those kernels replaced by `PackedWeight`s.

A kernel is packed when `model.quantization.format` is not "none", it is a linear of a
kind the released formats quantize (`PACKED_KINDS`: never routers, norms, embeddings or
the LM head, which stay bf16 in every release), and none of its checkpoint modules is on
`model.quantization.ignore` (exact module names, or "re:REGEX" matched from the start, as
compressed-tensors writes them). A stacked kernel (scanned layers, expert slots) is one
array: its layers are all packed or none, else the config is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
from flax import nnx

from hylora.core.config import Config
from hylora.core.errors import ConfigError
from hylora.quant.packed_weight import PackedWeight, is_packed

PACKED_KINDS = ("attention", "experts", "shared_experts", "dense_ffn", "expert_latent")
WEIGHT_SUFFIX = ".weight"


def _ignored(module: str, patterns: tuple[str, ...]) -> bool:
  for p in patterns:
    if p.startswith("re:"):
      if re.match(p[3:], module):
        return True
    elif module == p:
      return True
  return False


def _module(name: str) -> str:
  return name[:-len(WEIGHT_SUFFIX)] if name.endswith(WEIGHT_SUFFIX) else name


def packed_leaves(cfg: Config, tree: dict) -> dict[tuple, "object"]:
  """path -> `hylora.io.hf_names.Leaf` of every kernel of the pure-dict `tree` (bf16
  arrays or ShapeDtypeStructs) that the checkpoint packs."""
  q = cfg.model.quantization
  if q.format == "none":
    return {}
  from hylora.io.hf_names import plan
  out = {}
  for leaf in plan(cfg, tree):
    rule = leaf.tensor
    if not rule.linear or rule.fill or rule.kind not in PACKED_KINDS:
      continue
    # every layer of the stack, expert 0 (an ignore list names modules, not experts)
    index_sets = [(r, 0) if leaf.experts else (r,) for r in range(len(leaf.layers))
                 ] if leaf.layers is not None else [()]
    verdicts = {
        name: _ignored(_module(name), q.ignore) for index in index_sets
        for name in leaf.names_at(index)
    }
    if all(verdicts.values()):
      continue
    if any(verdicts.values()):
      kept = next(n for n, v in verdicts.items() if v)
      packed = next(n for n, v in verdicts.items() if not v)
      raise ConfigError(f"model.quantization.ignore: keeps {_module(kept)} in bf16 but not "
                        f"{_module(packed)}, which the model stores in the same array "
                        f"({leaf.key}); ignore both or neither")
    out[leaf.path] = leaf
  return out


def packed_axes(axes: tuple | None, stack_dims: int, in_dims: int) -> tuple | None:
  """A packed kernel's logical axes [*stack, N, K] from its bf16 kernel's
  [*stack, *in, *out]: the flattened dims keep their leading dim's axis."""
  if axes is None:
    return None
  return (*axes[:stack_dims], axes[stack_dims + in_dims], axes[stack_dims])


def _keys(path) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)


def pack_template(cfg: Config, frozen: nnx.State) -> nnx.State:
  """The abstract frozen state with each packed kernel's variable holding an abstract
  `PackedWeight` (its sharding metadata the packed layout's logical axes)."""
  packed = packed_leaves(cfg, nnx.to_pure_dict(frozen))
  if not packed:
    return frozen
  fmt = cfg.model.quantization.format

  def convert(path, variable):
    leaf = packed.get(_keys(path))
    if leaf is None:
      return variable
    n_in = leaf.tensor.in_dims
    item = leaf.item_shape
    try:
      value = PackedWeight.abstract(fmt, leaf.shape[:leaf.stack_dims], item[:n_in], item[n_in:])
    except ValueError as e:
      raise ConfigError(f"model.quantization.format: {leaf.key}: {e}") from None
    axes = packed_axes(variable.get_metadata().get("out_sharding"), leaf.stack_dims, n_in)
    return variable.replace(value, out_sharding=axes)

  return jax.tree_util.tree_map_with_path(convert, frozen,
                                          is_leaf=lambda x: isinstance(x, nnx.Variable))


def pack_values(cfg: Config, frozen: dict) -> dict:
  """A pure-dict frozen tree of bf16 kernels with the packed ones quantized (random
  bases, tests: the values a checkpoint of this format would hold)."""
  packed = packed_leaves(cfg, frozen)
  if not packed:
    return frozen
  fmt = cfg.model.quantization.format

  def convert(path, value):
    leaf = packed.get(_keys(path))
    if leaf is None:
      return value
    return PackedWeight.from_kernel(value, fmt, leaf.tensor.in_dims, leaf.stack_dims)

  return jax.tree_util.tree_map_with_path(convert, frozen)


def dequantized(frozen: dict, dtype=None) -> dict:
  """The frozen tree with every `PackedWeight` replaced by its bf16 (or `dtype`) kernel:
  the twin a bf16 checkpoint of the same values would load."""
  return jax.tree.map(
      lambda x: x.dequantize(dtype or jnp.bfloat16)
      if isinstance(x, PackedWeight) else x, frozen, is_leaf=lambda x: isinstance(x, PackedWeight))


@dataclasses.dataclass(frozen=True)
class BaseStorage:
  """How the frozen base sits in memory: its format, the kinds of kernels packed, and
  the bytes of every frozen array (whole model, all devices together) against a bf16
  base of the same parameters."""
  format: str
  packed_kinds: tuple[str, ...]
  packed_arrays: int
  nbytes: int
  bf16_nbytes: int


@functools.lru_cache(maxsize=16)  # building the abstract model takes seconds at full size
def _storage(model, lora) -> BaseStorage:
  from hylora.core.architecture import parameter_kind
  from hylora.core.config import Config
  from hylora.train.state import model_parts

  frozen = nnx.to_pure_dict(model_parts(Config(model=model, lora=lora)).frozen_template)
  kinds, packed, nbytes, bf16 = set(), 0, 0, 0
  flat = jax.tree_util.tree_flatten_with_path(frozen, is_leaf=is_packed)[0]
  for path, leaf in flat:
    if is_packed(leaf):
      kinds.add(parameter_kind(_keys(path)))
      packed += 1
      nbytes += leaf.nbytes
      bf16 += math.prod(leaf.shape) * 2
    else:
      size = math.prod(leaf.shape)
      nbytes += size * jnp.dtype(leaf.dtype).itemsize
      floating = jnp.issubdtype(leaf.dtype, jnp.floating)
      bf16 += size * (2 if floating else jnp.dtype(leaf.dtype).itemsize)
  return BaseStorage(model.quantization.format, tuple(sorted(kinds)), packed, nbytes, bf16)


def base_storage(cfg: Config) -> BaseStorage:
  return _storage(cfg.model, cfg.lora)

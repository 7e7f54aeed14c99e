"""How the frozen base sits in memory: its format, the kinds of kernels it packs and its
bytes against a bf16 base of the same parameters (the plan's `frozen base` line)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from hylora.core.architecture import parameter_kind
from hylora.core.config import Config
from hylora.plan.param_count import path_keys
from hylora.quant.packed_weight import is_packed


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
  from hylora.train.state import model_parts

  frozen = nnx.to_pure_dict(model_parts(Config(model=model, lora=lora)).frozen_template)
  kinds, packed, nbytes, bf16 = set(), 0, 0, 0
  flat = jax.tree_util.tree_flatten_with_path(frozen, is_leaf=is_packed)[0]
  for path, leaf in flat:
    if is_packed(leaf):
      kinds.add(parameter_kind(path_keys(path)))
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

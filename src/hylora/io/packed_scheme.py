"""Which frozen linears a quantized checkpoint packs, and the model's parameter tree
with those kernels replaced by `PackedWeight`s.

A kernel is packed when `model.quantization.format` is not "none", it is a linear of a
kind the released formats quantize (`hylora.io.hf_names.PACKABLE_KINDS`: never routers,
norms, embeddings or the LM head, which stay bf16 in every release), and none of its
checkpoint modules is on `model.quantization.ignore` (exact module names, or "re:REGEX"
matched from the start, as compressed-tensors writes them); `hf_names.packed_formats`
decides. A stacked kernel (scanned layers, expert slots) is one array: its layers are all
packed or none, else the config is refused.
"""

from __future__ import annotations

import jax
from flax import nnx

from hylora.core.config import Config
from hylora.core.errors import ConfigError
from hylora.io.hf_names import packed_formats, plan
from hylora.quant.packed_weight import PackedWeight, packed_axes


def leaves_to_pack(cfg: Config, tree: dict) -> dict[tuple, "object"]:
  """path -> `hylora.io.hf_names.Leaf` of every kernel of the pure-dict `tree` (bf16
  arrays or ShapeDtypeStructs) that the checkpoint packs (`hf_names.packed_formats`
  decides, from the checkpoint names)."""
  if cfg.model.quantization.format == "none":
    return {}
  packed = packed_formats(cfg, tree)
  return {leaf.path: leaf for leaf in plan(cfg, tree) if leaf.path in packed}


def _keys(path) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)


def pack_template(cfg: Config, frozen: nnx.State) -> nnx.State:
  """The abstract frozen state with each packed kernel's variable holding an abstract
  `PackedWeight` (its sharding metadata the packed layout's logical axes)."""
  packed = leaves_to_pack(cfg, nnx.to_pure_dict(frozen))
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
  packed = leaves_to_pack(cfg, frozen)
  if not packed:
    return frozen
  fmt = cfg.model.quantization.format

  def convert(path, value):
    leaf = packed.get(_keys(path))
    if leaf is None:
      return value
    return PackedWeight.from_kernel(value, fmt, leaf.tensor.in_dims, leaf.stack_dims)

  return jax.tree_util.tree_map_with_path(convert, frozen)

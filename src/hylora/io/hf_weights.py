"""Base weights in the Hugging Face layout (safetensors shards + config.json): loading
them into the sharded model, and writing a model out in the same layout.

Loading is lazy and local: every parameter is built with `jax.make_array_from_callback`,
which asks only for the slices this process's devices own; each slice is read from the
memory-mapped shards with `safe_open(...).get_slice`, so no host ever holds the whole
model. Names and layouts come from the one table in `hylora.io.hf_names`. Every problem
with the folder is a `WeightsError` naming the tensor (and file) at fault.

A packed frozen linear (`hylora.quant.PackedWeight`) is read and written as its checkpoint
ships it (`hylora.io.packed_tensors`): codes and scales stay bit-exact, each device reading
only its slices of both; a merged model of a packed base is written in bf16 only when asked
(`merge_dequantized`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import struct
from pathlib import Path
from typing import Iterable, Iterator

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from hylora.core import families
from hylora.core.config import Config, QuantizationConfig
from hylora.core.errors import ConfigError, WeightsError
from hylora.io.hf_names import Leaf, plan
from hylora.io.packed_tensors import LAYOUTS, PACKED_SUFFIXES, SHAPE_DTYPES, module
from hylora.quant.packed_weight import PackedWeight, is_packed
from pallas_kernels.quantized_matmul import formats

INDEX_FILE = "model.safetensors.index.json"
ACCEPTED_DTYPES = ("BF16", "F16", "F32")  # cast to the parameter's dtype on load
# a `.weight` stored quantized in place (FP8 checkpoints keep the name)
QUANTIZED_WEIGHT_DTYPES = ("F8_E4M3", "F8_E5M2")
ADAPTER_LEAVES = ("lora_a", "lora_b")
# dtypes safetensors' numpy reader cannot make (numpy has no float8): read from the bytes
RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn}


class CheckpointFiles:
  """The tensors of a folder of safetensors shards: name -> (file, shape, dtype), with
  lazily read slices. Only headers are read when opening."""

  def __init__(self, directory: str | Path):
    self.dir = Path(directory)
    if not self.dir.is_dir():
      raise WeightsError(f"base weights: {self.dir} is not a folder")
    listed = self._index()
    files = sorted(set(listed.values())) if listed else sorted(
        p.name for p in self.dir.glob("*.safetensors"))
    if not files:
      raise WeightsError(f"base weights: no *.safetensors files in {self.dir}")
    self.handles, self.info, self._maps = {}, {}, {}
    for name in files:
      self._open(name, [t for t, f in listed.items() if f == name])
    for tensor, name in listed.items():
      if tensor not in self.info:
        raise WeightsError(f"tensor {tensor!r}: {INDEX_FILE} places it in {name}, which does "
                           "not contain it")

  def _index(self) -> dict[str, str]:
    path = self.dir / INDEX_FILE
    if not path.exists():
      return {}
    try:
      return dict(json.loads(path.read_text())["weight_map"])
    except (ValueError, KeyError, TypeError) as e:
      raise WeightsError(f"{path}: not a safetensors index ({e})") from None

  def _open(self, name: str, expected: list[str]) -> None:
    path = self.dir / name
    held = f" (it should hold {', '.join(map(repr, expected[:3]))}" + (
        ", ...)" if len(expected) > 3 else ")") if expected else ""
    if not path.exists():
      raise WeightsError(f"{path}: listed in {INDEX_FILE} but missing{held}")
    try:
      handle = safe_open(str(path), framework="numpy")
      tensors = {t: handle.get_slice(t) for t in handle.keys()}
    except SafetensorError as e:
      raise WeightsError(f"{path}: truncated or corrupt safetensors file{held}: {e}") from None
    self.handles[name] = handle
    for tensor, view in tensors.items():
      if tensor in self.info:
        raise WeightsError(f"tensor {tensor!r} appears in both {self.info[tensor][0]} and {name}")
      self.info[tensor] = (name, tuple(view.get_shape()), view.get_dtype())

  def read(self, tensor: str, index: tuple[slice, ...]) -> np.ndarray:
    file, _, dtype = self.info[tensor]
    if dtype in RAW_DTYPES:
      return np.asarray(self._mapped(tensor)[index])
    return self.handles[file].get_slice(tensor)[index]

  def _mapped(self, tensor: str) -> np.ndarray:
    """The whole tensor as a memory map of its bytes (only the slices indexed are read)."""
    if tensor not in self._maps:
      file, shape, dtype = self.info[tensor]
      path = self.dir / file
      with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        begin, end = json.loads(f.read(size))[tensor]["data_offsets"]
      if end == begin:
        self._maps[tensor] = np.zeros(shape, RAW_DTYPES[dtype])
      else:
        data = np.memmap(path, np.uint8, mode="r", offset=8 + size + begin, shape=(end - begin,))
        self._maps[tensor] = data.view(RAW_DTYPES[dtype]).reshape(shape)
    return self._maps[tensor]


def _expected(leaves: Iterable[Leaf]) -> dict[str, tuple[Leaf, str]]:
  """checkpoint tensor name -> (leaf, role): "weight" for a plain tensor, else the packed
  tensor's role ("codes", "scales", "shape")."""
  out = {}
  for leaf in leaves:
    for _, names in leaf.items():
      for name in names:
        if leaf.packed is None:
          out[name] = (leaf, "weight")
        else:
          out.update({n: (leaf, role) for role, n in LAYOUTS[leaf.packed].names(name).items()})
  return out


def _optional(leaf: Leaf, role: str) -> bool:
  return leaf.tensor.optional or (role == "shape" and not LAYOUTS[leaf.packed].shape_required)


def check(files: CheckpointFiles, leaves: list[Leaf], extra: list[Leaf] = (),
          ignore: Iterable[str] = ()) -> None:
  """Every tensor present, known, of the right shape and dtype (a float dtype, or the
  packed format's tensors for packed leaves); `extra` leaves (trainable non-adapter
  parameters) may be present or not; names matching an `ignore` regex are not part of the
  model and are skipped."""
  need, may = _expected(leaves), _expected(extra)
  skip = [re.compile(p) for p in ignore]
  missing = [
      n for n, (leaf, role) in need.items() if n not in files.info and not _optional(leaf, role)
  ]
  if missing:
    leaf, role = need[missing[0]]
    if leaf.packed:
      _refuse_unpacked(files, leaf, missing[0], role)
    stand_in = [module(missing[0]) + "." + s for s in PACKED_SUFFIXES]
    stand_in = [n for n in stand_in if n in files.info]
    if stand_in:
      raise WeightsError(f"tensor {stand_in[0]!r} in {files.info[stand_in[0]][0]}: stored "
                         f"quantized, but the model keeps {missing[0]!r} in bf16 "
                         f"({_quantization_words(leaf)})")
    more = f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""
    raise WeightsError(f"tensor {missing[0]!r} is missing from {files.dir} (model parameter "
                       f"{leaf.key}){more}")
  for name, (file, shape, dtype) in files.info.items():
    leaf, role = need.get(name) or may.get(name) or (None, None)
    if leaf is None:
      if any(p.search(name) for p in skip):
        continue
      plain = module(name) + ".weight"
      if name.rsplit(".", 1)[-1] in PACKED_SUFFIXES and plain in need:
        raise WeightsError(f"tensor {name!r} in {file}: stored quantized, but the model keeps "
                           f"{plain!r} in bf16 ({_quantization_words(need[plain][0])})")
      raise WeightsError(f"unexpected tensor {name!r} in {file}: no model parameter maps to it "
                         f"(the name map of this model's family; check the model config, or "
                         "skip it with --ignore-tensors REGEX)")
    if role == "weight":
      _check_plain(name, file, shape, dtype, leaf)
    else:
      _check_packed(files, name, file, shape, dtype, leaf, role)


def _quantization_words(leaf: Leaf) -> str:
  return ("the checkpoint config's quantization_config leaves it out: model.quantization "
          f"format / ignore; parameter {leaf.key}")


def _check_plain(name, file, shape, dtype, leaf: Leaf) -> None:
  want = leaf.tensor_shape()
  if shape != want:
    raise WeightsError(f"tensor {name!r} in {file}: shape {list(shape)}, but the model expects "
                       f"{list(want)} (parameter {leaf.key}, shape {list(leaf.shape)})")
  if dtype in QUANTIZED_WEIGHT_DTYPES:
    raise WeightsError(f"tensor {name!r} in {file}: stored quantized ({dtype}), but the model "
                       f"keeps it in bf16 ({_quantization_words(leaf)})")
  if dtype not in ACCEPTED_DTYPES:
    raise WeightsError(f"tensor {name!r} in {file}: dtype {dtype}, expected one of "
                       f"{'/'.join(ACCEPTED_DTYPES)}")


def _check_packed(files, name, file, shape, dtype, leaf: Leaf, role: str) -> None:
  layout = LAYOUTS[leaf.packed]
  out_n, in_k = leaf.tensor_shape()
  what = f"{leaf.packed} {role} of a [{out_n}, {in_k}] weight, parameter {leaf.key}"
  if role == "shape":
    if dtype not in SHAPE_DTYPES or shape != (2,):
      raise WeightsError(f"tensor {name!r} in {file}: {dtype} {list(shape)}, expected "
                         f"{' or '.join(SHAPE_DTYPES)} [2] ({what})")
    said = [int(v) for v in files.read(name, (slice(None),))]
    if said != [out_n, in_k]:
      codes = layout.names(module(name) + ".weight")["codes"]
      raise WeightsError(f"tensor {name!r} in {file}: says [{said[0]}, {said[1]}], but "
                         f"{codes!r} packs a [{out_n}, {in_k}] weight as the model expects "
                         f"(parameter {leaf.key})")
    return
  want_dtype = layout.codes_dtype if role == "codes" else layout.scales_dtype
  want = (layout.codes_shape if role == "codes" else layout.scales_shape)(out_n, in_k)
  if role == "codes" and dtype in ACCEPTED_DTYPES and dtype != want_dtype:
    raise WeightsError(f"tensor {name!r} in {file}: stored as {dtype}, but the checkpoint "
                       f"config's quantization packs it ({what})")
  if dtype != want_dtype:
    raise WeightsError(f"tensor {name!r} in {file}: dtype {dtype}, expected {want_dtype} "
                       f"({what})")
  if shape != want:
    raise WeightsError(f"tensor {name!r} in {file}: shape {list(shape)}, expected "
                       f"{list(want)} ({what})")


def _refuse_unpacked(files: CheckpointFiles, leaf: Leaf, missing: str, role: str) -> None:
  """A packed tensor is missing: name what the folder holds instead."""
  layout = LAYOUTS[leaf.packed]
  plain = module(missing) + ".weight"
  names = layout.names(plain)
  if role == "scales" and names["codes"] in files.info:
    codes, (file, _, dtype) = names["codes"], files.info[names["codes"]]
    if dtype != layout.codes_dtype:
      raise WeightsError(f"tensor {codes!r} in {file}: stored as {dtype}, but the checkpoint "
                         f"config's quantization packs it ({leaf.packed}, parameter {leaf.key})")
    raise WeightsError(f"tensor {missing!r} is missing from {files.dir}: the {leaf.packed} "
                       f"scales of {codes!r} (model parameter {leaf.key})")
  if plain in files.info and plain != missing:
    file, _, dtype = files.info[plain]
    raise WeightsError(f"tensor {plain!r} in {file}: stored as {dtype}, but the checkpoint "
                       f"config's quantization packs it ({leaf.packed}: expected "
                       f"{' + '.join(repr(n) for n in names.values())}; parameter {leaf.key})")


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
  return [s.indices(n)[:2] for s, n in zip(index, shape)]


def _flat_span(bounds, shape) -> tuple[int, int]:
  """Flat range covering a block whose first dim is cut and the others read whole."""
  rest = math.prod(shape[1:])
  return bounds[0][0] * rest, bounds[0][1] * rest


def _read_item(leaf: Leaf, files: CheckpointFiles, names, bounds) -> np.ndarray:
  rule, item = leaf.tensor, leaf.item_shape
  cut = tuple(slice(a, b) for a, b in bounds)
  if rule.optional and names[0] not in files.info:
    return np.zeros([b - a for a, b in bounds], np.float32)
  if not rule.linear:
    if leaf.tensor_shape() != item:  # stored as a reshape: small tensors, read whole
      whole = files.read(names[0], tuple(slice(None) for _ in leaf.tensor_shape()))
      return whole.reshape(item)[cut]
    return files.read(names[0], cut)
  n = rule.in_dims
  in_shape, out_shape = item[:n], item[n:]
  col_lo, col_hi = _flat_span(bounds[:n], in_shape)
  row_lo, row_hi = _flat_span(bounds[n:], out_shape)
  part = math.prod(out_shape) // len(names)
  pieces = []
  for p, name in enumerate(names):  # fused tensors: rows [p * part, (p + 1) * part)
    lo, hi = max(row_lo, p * part), min(row_hi, (p + 1) * part)
    if lo < hi:
      pieces.append(files.read(name, (slice(lo - p * part, hi - p * part), slice(col_lo, col_hi))))
  block = np.concatenate(pieces, axis=0).T  # [in, out]
  block = block.reshape(bounds[0][1] - bounds[0][0], *in_shape[1:], bounds[n][1] - bounds[n][0],
                        *out_shape[1:])
  return block[(slice(None), *cut[1:n], slice(None), *cut[n + 1:])]


def read_block(leaf: Leaf, files: CheckpointFiles, index: tuple[slice, ...]) -> np.ndarray:
  """The model-layout block `leaf[index]`, read from the checkpoint."""
  bounds = _bounds(index, leaf.shape)
  if leaf.tensor.fill == "expert_ids":
    ids = (np.arange(leaf.shape[-1]) % leaf.routed).astype(leaf.dtype)  # initial placement
    return np.broadcast_to(ids, leaf.shape)[tuple(slice(a, b) for a, b in bounds)].copy()
  stack, item = bounds[:leaf.stack_dims], bounds[leaf.stack_dims:]
  ranges = [range(a, b) for a, b in stack]
  blocks = [_read_item(leaf, files, leaf.names_at(i), item) for i in itertools.product(*ranges)]
  out = np.stack(blocks).reshape(*map(len, ranges), *blocks[0].shape) if ranges else blocks[0]
  return np.asarray(out).astype(leaf.dtype)


def _build(leaf: Leaf, files: CheckpointFiles, sharding) -> jax.Array:
  cache = {}  # devices holding the same slice (replicas) share one read

  def slice_for(index):
    key = tuple(_bounds(index, leaf.shape))
    if key not in cache:
      cache[key] = read_block(leaf, files, index)
    return cache[key]

  return jax.make_array_from_callback(leaf.shape, sharding, slice_for)


# ---- packed leaves ---------------------------------------------------------------------


def packed_shapes(leaf: Leaf) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The codes and scales shapes of a packed leaf: [*stack, N, K / per_code] and
  [*stack, scale rows, scale columns] (N: every fused part's outputs)."""
  out_n, in_k = leaf.tensor_shape()
  fmt, stack = formats.get(leaf.packed), leaf.shape[:leaf.stack_dims]
  n = out_n * len(leaf.name_template)
  return (*stack, *fmt.codes_shape(n, in_k)), (*stack, *fmt.scales_shape(n, in_k))


def _read_rows(files: CheckpointFiles, names, part: int, rows, read) -> np.ndarray:
  """Rows [lo, hi) of the parts `names` stacked along out (`part` rows each), one read
  per part touched; `read(name, lo, hi)` reads rows of one part."""
  pieces = []
  for p, name in enumerate(names):
    lo, hi = max(rows[0], p * part), min(rows[1], (p + 1) * part)
    if lo < hi:
      pieces.append(read(name, lo - p * part, hi - p * part))
  return np.concatenate(pieces, axis=0)


def read_packed_block(leaf: Leaf, files: CheckpointFiles, role: str,
                      index: tuple[slice, ...]) -> np.ndarray:
  """The block `codes[index]` or `scales[index]` of a packed leaf, read from the
  checkpoint's tensors as they are (int4's int32 words are viewed as their bytes)."""
  layout = LAYOUTS[leaf.packed]
  shape = packed_shapes(leaf)[role == "scales"]
  bounds = _bounds(index, shape)
  stack, (rows, cols) = bounds[:leaf.stack_dims], bounds[leaf.stack_dims:]
  part = shape[-2] // len(leaf.name_template)

  def read(weight_name, lo, hi):
    name = layout.names(weight_name)[role]
    if role == "scales":
      return files.read(name, (slice(lo, hi), slice(*cols)))
    stored, cut = layout.columns(*cols)
    return layout.codes_from_disk(files.read(name, (slice(lo, hi), stored)))[:, cut]

  ranges = [range(a, b) for a, b in stack]
  blocks = [
      _read_rows(files, leaf.names_at(i), part, rows, read) for i in itertools.product(*ranges)
  ]
  out = np.stack(blocks).reshape(*map(len, ranges), *blocks[0].shape) if ranges else blocks[0]
  fmt = formats.get(leaf.packed)
  return np.asarray(out).astype(fmt.codes_dtype if role == "codes" else fmt.scales_dtype,
                                copy=False)


def _build_packed(leaf: Leaf, files: CheckpointFiles, abstract: PackedWeight) -> PackedWeight:
  codes_shape, scales_shape = packed_shapes(leaf)
  for role, want, got in (("codes", codes_shape, abstract.codes), ("scales", scales_shape,
                                                                   abstract.scales)):
    fmt = formats.get(leaf.packed)
    dtype = np.dtype(fmt.codes_dtype if role == "codes" else fmt.scales_dtype)
    if tuple(got.shape) != want or np.dtype(got.dtype) != dtype:
      raise ConfigError(f"model parameter {leaf.key}: packed {role} {got.dtype} "
                        f"{list(got.shape)}, the {leaf.packed} format gives {dtype} {list(want)}")

  def build(role, target):
    cache = {}

    def slice_for(index):
      key = tuple(_bounds(index, target.shape))
      if key not in cache:
        cache[key] = read_packed_block(leaf, files, role, index)
      return cache[key]

    return jax.make_array_from_callback(tuple(target.shape), target.sharding, slice_for)

  return dataclasses.replace(abstract, codes=build("codes", abstract.codes),
                             scales=build("scales", abstract.scales))


def flat_paths(tree) -> dict[tuple, object]:
  """path -> leaf, a `PackedWeight` counting as one leaf."""
  return {
      tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path):
          v for path, v in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_packed)[0]
  }


def _unflatten_like(tree, values: dict[tuple, object]):
  paths = flat_paths(tree)
  return jax.tree.unflatten(jax.tree.structure(tree, is_leaf=is_packed), [values[p] for p in paths])


def non_adapters(tree) -> dict:
  """The trainable leaves that are not LoRA factors (e.g. depth-mix residual weights)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: None if getattr(path[-1], "key", None) in ADAPTER_LEAVES else x, tree)


def load(directory: str | Path, cfg: Config, frozen_abstract: dict, lora=None):
  """(frozen, lora): the frozen parameters read from `directory` (ShapeDtypeStructs with
  shardings in `frozen_abstract`), and `lora` with any trainable non-adapter parameter
  the checkpoint holds (e.g. from a merged export) replaced by the stored value."""
  hf = check_config(Path(directory), cfg)
  files = CheckpointFiles(directory)
  leaves = plan(cfg, frozen_abstract)
  extras = plan(cfg, non_adapters(lora)) if lora is not None else []
  check(files, leaves, extras, ignored(cfg, hf))
  abstract = flat_paths(frozen_abstract)
  frozen = _unflatten_like(
      frozen_abstract, {
          leaf.path: (_build_packed(leaf, files, abstract[leaf.path]) if leaf.packed else _build(
              leaf, files, abstract[leaf.path].sharding)) for leaf in leaves
      })
  if lora is not None:
    present = {
        leaf.path: leaf
        for leaf in extras
        if all(n in files.info for _, names in leaf.items() for n in names)
    }
    values = {
        p: (_build(present[p], files, v.sharding) if p in present else v)
        for p, v in flat_paths(lora).items()
    }
    lora = _unflatten_like(lora, values)
  return frozen, lora


def ignored(cfg: Config, hf: dict) -> tuple[str, ...]:
  """The regexes of checkpoint tensors that are not the model's: the family's own (e.g.
  multi-token-prediction layers) and `checkpoint.ignore_tensors`."""
  user = (cfg.checkpoint.ignore_tensors,) if cfg.checkpoint.ignore_tensors else ()
  return families.ignored_tensors(hf) + user


def check_config(directory: Path, cfg: Config) -> dict:
  """The checkpoint's config.json, checked against the model's architecture."""
  path = directory / "config.json"
  if not path.exists():
    raise WeightsError(f"base weights: {path} is missing (the model's config.json)")
  try:
    hf = json.loads(path.read_text())
  except ValueError as e:
    raise WeightsError(f"{path}: not valid JSON ({e})") from None
  differs = families.mismatch(hf, cfg.model)
  if differs is not None:
    raise ConfigError(f"{differs.split('=')[0]}: the base weights' config.json ({path}) says "
                      f"{differs.split('=', 1)[1]}, the model config differs (drop the model "
                      "overrides, or pick the preset of this checkpoint)")
  return hf


def hf_config(cfg: Config, dequantized: bool = False) -> dict:
  """The config.json written next to exported weights: the base checkpoint's own for a
  released family, else the house config that rebuilds the model; `dequantized` (a
  bf16 copy of a packed base) drops the quantization."""
  from hylora.core.overrides import to_dict

  if cfg.model.family != "hylora" and cfg.checkpoint.base_weights:
    hf = families.read_config(cfg.checkpoint.base_weights)
    if dequantized:
      for section in (hf, hf.get("text_config") or {}):
        section.pop("quantization_config", None)
    return hf
  m = cfg.model
  if dequantized:
    m = dataclasses.replace(m, quantization=QuantizationConfig())
  return {
      "architectures": ["HybridLMForCausalLM"],
      "model_type": families.HOUSE_MODEL_TYPE,
      "vocab_size": m.vocab_size,
      "hidden_size": m.d_model,
      "num_hidden_layers": m.layers,
      "intermediate_size": m.dense_ffn,
      "first_k_dense_replace": m.dense_layers,
      "n_routed_experts": m.moe.experts,
      "num_experts_per_tok": m.moe.top_k,
      "moe_intermediate_size": m.moe.expert_ffn,
      "n_shared_experts": m.moe.shared_experts,
      "rms_norm_eps": m.norm_eps,
      "tie_word_embeddings": False,
      "hylora_model": to_dict(m)
  }


# ---- writing ---------------------------------------------------------------------------


def item_reader(array: jax.Array, stack_dims: int):
  """index -> the host copy of `array[index]` (one layer / expert slice), gathered on every
  process (a collective: all processes call it in the same order)."""
  if array.is_fully_addressable:  # one process: copy the leaf to the host once
    host = np.asarray(array)
    return lambda index: host[tuple(index)]
  replicated = NamedSharding(array.sharding.mesh, P())

  def take(a, *index):
    for i in index:
      a = jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False)
    return a

  fn = jax.jit(take, out_shardings=replicated)
  return lambda index: np.asarray(fn(array, *(np.int32(i) for i in index)))


def to_tensors(leaf: Leaf, item: np.ndarray) -> list[np.ndarray]:
  """One model-layout slice -> its checkpoint tensors (inverse of `_read_item`)."""
  if not leaf.tensor.linear:
    return [item.reshape(leaf.tensor_shape())]
  n_in = math.prod(leaf.item_shape[:leaf.tensor.in_dims])
  return np.split(item.reshape(n_in, -1).T, len(leaf.name_template), axis=0)


def packed_tensors(leaf: Leaf, names, codes: np.ndarray,
                   scales: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
  """One slice's codes [N, K / per_code] and scales -> its checkpoint tensors, as the
  format ships them (inverse of `read_packed_block`): fused parts split along out."""
  layout = LAYOUTS[leaf.packed]
  out_n, in_k = leaf.tensor_shape()
  parts = len(names)
  for name, c, sc in zip(names, np.split(codes, parts), np.split(scales, parts)):
    tensors = layout.names(name)
    yield tensors["codes"], layout.codes_to_disk(c)
    yield tensors["scales"], sc
    if layout.shape_required:
      yield tensors["shape"], np.array([out_n, in_k], np.int32)


def dequantized_item(leaf: Leaf, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """One packed slice as its bf16 model-layout kernel [*in, *out]."""
  n_in, item = leaf.tensor.in_dims, leaf.item_shape
  return np.asarray(PackedWeight(codes, scales, leaf.packed, item[:n_in], item[n_in:]).dequantize())


def expert_slots(leaf: Leaf, frozen_flat: dict):
  """index (layer, logical expert) -> (layer, storage slot) under the layer's expert
  placement; the identity for leaves without an expert axis."""
  if not leaf.experts:
    return lambda index: index
  table = np.asarray(frozen_flat[leaf.path[:-2] + ("placement",)])  # [layers, slots]
  slot_of = [{int(e): s for s, e in reversed(list(enumerate(row)))} for row in table]
  return lambda index: (index[0], slot_of[index[0]][index[1]])


def adapter_paths(leaf: Leaf) -> tuple[tuple, tuple] | None:
  if leaf.tensor.adapter is None:
    return None
  base = leaf.path[:len(leaf.path) - len(leaf.tensor.path.split("/"))]
  module = base + tuple(leaf.tensor.adapter.split("/"))
  return module + ("lora_a",), module + ("lora_b",)


def lora_delta(a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
  """scale * A B for one slice: A [*in, r], B [r, *out] -> [*in, *out] (fp32)."""
  return scale * np.tensordot(a.astype(np.float32), b.astype(np.float32), axes=1)


def packed_leaves(cfg: Config, frozen: dict) -> list[Leaf]:
  return [leaf for leaf in plan(cfg, frozen) if leaf.packed]


def merged_bytes(cfg: Config, frozen: dict, lora: dict | None = None) -> int:
  """The size of a merged copy: every packed weight in bf16, the rest as stored."""
  total = 0
  trees = [frozen] + ([non_adapters(lora)] if lora is not None else [])
  for tree in trees:
    source = flat_paths(tree)
    for leaf in plan(cfg, tree):
      if leaf.tensor.fill:
        continue
      itemsize = 2 if leaf.packed else np.dtype(source[leaf.path].dtype).itemsize
      total += math.prod(leaf.item_shape) * itemsize * sum(1 for _ in leaf.items())
  return total


def check_merge(cfg: Config, frozen: dict, merge_dequantized: bool) -> None:
  """A merged model of a packed base is written only as an explicit bf16 copy."""
  packed = packed_leaves(cfg, frozen)
  if packed and not merge_dequantized:
    raise ConfigError(f"merge: the base is packed ({packed[0].packed}, e.g. "
                      f"{packed[0].key}); the merged model can only be written in bf16, "
                      "asked for with merge_dequantized=True (--merge-dequantized)")


def model_tensors(cfg: Config, frozen: dict, lora: dict | None = None, merge: bool = False,
                  merge_dequantized: bool = False) -> Iterator[tuple[str, np.ndarray]]:
  """(checkpoint name, host array) for every tensor of the model, one slice at a time;
  with `merge`, adapted weights become base + scale * B @ A, and trainable non-adapter
  parameters are written too. Packed weights are written as their format ships them;
  merging a packed base needs `merge_dequantized`, which writes them in bf16."""
  if merge:
    check_merge(cfg, frozen, merge_dequantized)
  arrays = flat_paths(frozen)
  adapters = flat_paths(lora) if (merge and lora is not None) else {}
  trees = [frozen] + ([non_adapters(lora)] if adapters else [])
  for tree in trees:
    source = flat_paths(tree)
    for leaf in plan(cfg, tree):
      if leaf.tensor.fill:
        continue
      value = source[leaf.path]
      if leaf.packed:
        codes_read = item_reader(value.codes, leaf.stack_dims)
        scales_read = item_reader(value.scales, leaf.stack_dims)

        def read(index, leaf=leaf, codes_read=codes_read, scales_read=scales_read):
          return dequantized_item(leaf, codes_read(index), scales_read(index))
      else:
        read = item_reader(value, leaf.stack_dims)
      slot = expert_slots(leaf, arrays)
      pair = adapter_paths(leaf)
      a_read = b_read = None
      if pair and pair[0] in adapters:
        a, b = adapters[pair[0]], adapters[pair[1]]
        a_dims = a.ndim - leaf.tensor.in_dims - 1  # one less than the leaf's: A shared by experts
        a_read, b_read = item_reader(a, a_dims), item_reader(b, leaf.stack_dims)
      for index, names in leaf.items():
        index = slot(index)
        if leaf.packed and not merge:
          yield from packed_tensors(leaf, names, codes_read(index), scales_read(index))
          continue
        item = read(index)
        if a_read is not None:
          delta = lora_delta(a_read(index[:a_dims]), b_read(index), cfg.lora.scale)
          item = (item.astype(np.float32) + delta).astype(item.dtype)
        yield from zip(names, to_tensors(leaf, item))


def write_sharded(directory: str | Path, tensors: Iterable[tuple[str, np.ndarray]],
                  max_shard_bytes: int = 4 << 30) -> list[str]:
  """Writes `model-0000i-of-0000n.safetensors` shards + the index (process 0 writes; every
  process must iterate `tensors`, whose gathers are collectives)."""
  out = Path(directory)
  write = jax.process_index() == 0
  if write:
    out.mkdir(parents=True, exist_ok=True)
  shards, current, size, weight_map, total = [], {}, 0, {}, 0

  def flush():
    nonlocal current, size
    if current and write:
      name = f"part-{len(shards):05d}.safetensors"
      save_file(current, str(out / name))
      shards.append((name, list(current)))
    current, size = {}, 0

  for name, array in tensors:
    if current and size + array.nbytes > max_shard_bytes:
      flush()
    current[name] = np.ascontiguousarray(array)
    size += array.nbytes
    total += array.nbytes
  flush()
  if not write:
    return []
  final = []
  for i, (tmp, names) in enumerate(shards):
    name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    (out / tmp).rename(out / name)
    weight_map.update({n: name for n in names})
    final.append(name)
  index = {"metadata": {"total_size": total}, "weight_map": weight_map}
  (out / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
  return final


def save(directory: str | Path, cfg: Config, frozen: dict, lora: dict | None = None,
         merge: bool = False, max_shard_bytes: int = 4 << 30,
         merge_dequantized: bool = False) -> list[str]:
  """The model (merged with its adapters when `merge`) as an HF-layout folder; a packed
  base is written as it ships, or merged into a bf16 copy with `merge_dequantized`."""
  dequantized = merge and bool(packed_leaves(cfg, frozen))
  if merge:
    check_merge(cfg, frozen, merge_dequantized)
  if dequantized and jax.process_index() == 0:
    print(
        f"merged model in bf16 (the packed base dequantized): "
        f"{merged_bytes(cfg, frozen, lora) / 1e9:.2f} GB to write to {directory}", flush=True)
  files = write_sharded(directory, model_tensors(cfg, frozen, lora, merge, merge_dequantized),
                        max_shard_bytes)
  if jax.process_index() == 0:
    config = hf_config(cfg, dequantized=dequantized)
    (Path(directory) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  return files

"""Tiny quantized checkpoints, one per packed format, written here tensor by tensor in the
layout their publishers ship (independently of hylora.io's writer): DeepSeek-V3.2 in
block FP8, Kimi K3 with MXFP4 routed experts, the house model with compressed-tensors
INT4; with the packed frozen trees that load them and the bf16 twin of each."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import fixture_config, released_config, tiny_k3_config, two_layer_config
from hylora.core.config import QuantizationConfig
from hylora.io import hf_weights
from hylora.io.hf_names import packed_formats, plan
from hylora.quant.packed_weight import PackedWeight
from hylora.train import state as st
from meshes.mesh import build_mesh
from pallas_kernels.quantized_matmul import formats
from weights_helpers import random_tree

FP8_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128]
}
INT4_CONFIG = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int"
            }
        }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed"
}
FORMATS = ("fp8_block", "mxfp4", "int4")


def hf_config(fmt: str, layers: int = 3) -> dict | None:
  """The config.json of the released family that ships `fmt` (None: the house model), cut
  to its first `layers` layers: 3 holds each family's every layer kind; 2 holds the dense
  FFN and the routed experts (DeepSeek-V3.2: every kind; Kimi K3: KDA only, no MLA)."""
  if fmt == "fp8_block":  # DeepSeek-V3.2: fused gate/up parts of whole 128-row blocks
    hf = fixture_config("deepseek_v32")
    hf.update(intermediate_size=128, moe_intermediate_size=128, quantization_config=FP8_CONFIG,
              num_hidden_layers=layers, layer_types=hf["layer_types"][:layers],
              mlp_layer_types=hf["mlp_layer_types"][:layers])
    return hf
  if fmt == "mxfp4":  # Kimi K3: routed experts only, inputs in groups of 32
    from hylora.core.families import published
    hf = tiny_k3_config(layers=layers)
    hf["text_config"].update(
        routed_expert_hidden_size=64,
        quantization_config=published("kimi-k3")["text_config"]["quantization_config"])
    return hf
  return None


def config(fmt: str, layers: int = 3):
  hf = hf_config(fmt, layers)
  if hf is not None:
    return released_config(hf)
  cfg = two_layer_config()
  ignore = tuple(INT4_CONFIG["ignore"])
  return dataclasses.replace(
      cfg, model=dataclasses.replace(cfg.model, quantization=QuantizationConfig("int4", ignore)))


def bf16_twin(cfg):
  return dataclasses.replace(
      cfg, model=dataclasses.replace(cfg.model, quantization=QuantizationConfig()))


def _free_axis(mesh, used, size):
  for axis in mesh.axis_names:
    if axis not in used and mesh.shape[axis] > 1 and size % mesh.shape[axis] == 0:
      return axis
  return None


def packed_abstract(cfg, mesh, frozen: dict) -> dict:
  """`frozen` (ShapeDtypeStructs with shardings) with every leaf the checkpoint packs
  replaced by a PackedWeight of ShapeDtypeStructs: the stack axes sharded as the kernel,
  the codes also cut along out and in, the scales along their rows, where a free mesh
  axis divides them (so that loading reads true sub-blocks)."""
  packed = packed_formats(cfg, frozen)
  leaves = {leaf.path: leaf for leaf in plan(cfg, frozen)}
  flat = hf_weights.flat_paths(frozen)

  def one(path, x):
    if path not in packed:
      return x
    leaf = leaves[path]
    stack = x.shape[:leaf.stack_dims]
    in_shape = x.shape[leaf.stack_dims:leaf.stack_dims + leaf.tensor.in_dims]
    out_shape = x.shape[leaf.stack_dims + leaf.tensor.in_dims:]
    pw = PackedWeight.abstract(packed[path], stack, in_shape, out_shape)
    spec = tuple(x.sharding.spec) + (None,) * (len(x.shape) - len(x.sharding.spec))
    stack_spec = spec[:leaf.stack_dims]
    used = {a for s in stack_spec if s for a in ((s,) if isinstance(s, str) else s)}
    n_axis = _free_axis(mesh, used, pw.codes.shape[-2])
    k_axis = _free_axis(mesh, used | {n_axis}, pw.codes.shape[-1])
    rows_axis = _free_axis(mesh, used, pw.scales.shape[-2])
    attach = lambda a, *s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
        mesh, P(*stack_spec, *s)))
    return dataclasses.replace(pw, codes=attach(pw.codes, n_axis, k_axis),
                               scales=attach(pw.scales, rows_axis, None))

  return hf_weights._unflatten_like(frozen, {p: one(p, v) for p, v in flat.items()})


@dataclasses.dataclass
class Quantized:
  cfg: object
  mesh: object
  parts: object
  lora: dict  # random adapters (B non-zero)
  frozen_bf16: dict  # the bf16 abstract tree
  frozen_packed: dict  # the packed abstract tree
  values: dict  # path -> host bf16 model-layout values (the plain leaves' and the originals)
  codes: dict  # path -> (codes, scales) as written, [*stack, N, K / per_code]


def build(fmt: str, seed: int = 0, layers: int = 3) -> Quantized:
  cfg = config(fmt, layers)
  mesh = build_mesh(cfg.mesh)
  parts = st.model_parts(bf16_twin(cfg))
  lora_abstract, frozen_bf16 = st.abstract_arrays(parts, mesh)
  values = {
      p: np.asarray(v) for p, v in hf_weights.flat_paths(random_tree(frozen_bf16, seed)).items()
  }
  lora = random_tree(lora_abstract, seed + 1)
  return Quantized(cfg, mesh, parts, lora, frozen_bf16, packed_abstract(cfg, mesh, frozen_bf16),
                   values, {})


def pack_int32(codes: np.ndarray) -> np.ndarray:
  """uint8 [out, in/2] (two nibbles each, low first) -> int32 [out, in/8] as
  compressed-tensors packs: element i of a word in bits 4i..4i+3."""
  nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(codes.shape[0], -1, 8)
  words = np.zeros(nibbles.shape[:2], np.uint32)
  for i in range(8):
    words |= nibbles[..., i].astype(np.uint32) << np.uint32(4 * i)
  return words.view(np.int32)


def shipped_tensors(fmt: str, name: str, codes: np.ndarray, scales: np.ndarray,
                    shape: tuple[int, int]) -> dict[str, np.ndarray]:
  """One [out, in] matrix's codes and scales as their publisher ships them."""
  base = name[:-len(".weight")]
  if fmt == "fp8_block":
    return {name: codes, f"{base}.weight_scale_inv": scales}
  tensors = {f"{base}.weight_packed": codes, f"{base}.weight_scale": scales}
  if fmt == "int4":
    tensors[f"{base}.weight_packed"] = pack_int32(codes)
    tensors[f"{base}.weight_shape"] = np.array(shape, np.int32)
  return tensors


def quantized_matrices(fmt: str, matrices: list[np.ndarray]):
  """Each bf16 [out, in] matrix quantized on its own (one program for all of them):
  [(codes, scales)]."""
  codes, scales = (np.asarray(a) for a in formats.quantize(np.stack(matrices), fmt))
  return list(zip(codes, scales))


def write_folder(q: Quantized, folder: Path, twin: bool = False) -> Path:
  """The quantized checkpoint of `q` (every packed module quantized on its own), or with
  `twin` its bf16 twin: the same checkpoint with each packed module's dequantized values.
  Fills `q.codes` with the codes and scales as the packed leaves hold them."""
  folder.mkdir(parents=True, exist_ok=True)
  tensors = {}
  packed = packed_formats(q.cfg, q.frozen_bf16)
  for leaf in plan(q.cfg, q.frozen_bf16):
    if leaf.tensor.fill:
      continue
    value = q.values[leaf.path]
    fmt = packed.get(leaf.path)
    items = [(index, names, hf_weights.to_tensors(leaf, value[index] if index else value))
             for index, names in leaf.items()]
    if fmt is None:
      for _, names, matrices in items:
        tensors.update(zip(names, matrices))
      continue
    flat = quantized_matrices(fmt, [m for _, _, ms in items for m in ms])
    if twin:
      dequantized = np.asarray(
          formats.dequantize(np.stack([c for c, _ in flat]), np.stack([s for _, s in flat]), fmt))
    per_item, at = {}, 0
    for index, names, matrices in items:
      pieces = flat[at:at + len(names)]
      for j, (name, matrix, (codes, scales)) in enumerate(zip(names, matrices, pieces)):
        if twin:
          tensors[name] = dequantized[at + j]
        else:
          tensors.update(shipped_tensors(fmt, name, codes, scales, matrix.shape))
      per_item[index] = tuple(np.concatenate(p) for p in zip(*pieces))
      at += len(names)
    stack = leaf.shape[:leaf.stack_dims]
    # the model's slots: slot s holds expert s mod E (the initial placement)
    grid = [
        per_item[tuple(i % leaf.routed if leaf.experts and d == len(stack) - 1 else i
                       for d, i in enumerate(idx))]
        for idx in np.ndindex(*stack)
    ]
    q.codes[leaf.path] = tuple(
        np.stack([g[r] for g in grid]).reshape(*stack, *grid[0][r].shape) for r in (0, 1))
  from safetensors.numpy import save_file
  save_file({
      n: np.ascontiguousarray(t) for n, t in tensors.items()
  }, str(folder / "model.safetensors"))
  hf = hf_config_of(q.cfg, twin)
  (folder / "config.json").write_text(json.dumps(hf, indent=1))
  return folder


def hf_config_of(cfg, twin: bool) -> dict:
  fmt = cfg.model.quantization.format
  hf = hf_config(fmt, cfg.model.layers)
  if hf is None:
    model = bf16_twin(cfg).model if twin else cfg.model
    return hf_weights.hf_config(dataclasses.replace(cfg, model=model))
  if twin:
    for section in (hf, hf.get("text_config") or {}):
      section.pop("quantization_config", None)
  return hf


def raw_tensors(folder: Path) -> dict[str, tuple[str, list[int], bytes]]:
  """name -> (safetensors dtype, shape, bytes) of every tensor of a folder, read from the
  files' own headers (no dtype conversion anywhere)."""
  out = {}
  for path in sorted(folder.glob("*.safetensors")):
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    for name, info in header.items():
      if name == "__metadata__":
        continue
      begin, end = info["data_offsets"]
      out[name] = (info["dtype"], info["shape"], data[8 + size + begin:8 + size + end])
  return out

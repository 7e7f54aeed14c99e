"""LoRA adapters out in the PEFT layout, optionally with merged base weights.

`adapter_model.safetensors` holds, for every adapted module of the Hugging Face layout
(names from hylora.io.hf_names),
  base_model.model.<module>.lora_A.weight  [r, in]   (A transposed, in = flattened input)
  base_model.model.<module>.lora_B.weight  [out, r]  (B transposed)
so that PEFT computes W x + (lora_alpha / r) * B A x, exactly the model's adapter.

* Fused gate_up: the model adapts the fused `[d, 2f]` kernel with one A and one B
  `[r, 2f]`. The checkpoint has separate gate_proj and up_proj modules, so each gets
  its own adapter: both share A (written twice), gate_proj takes B's first f columns
  and up_proj the rest; this is exact.
* Routed experts: one adapter per expert, `mlp.experts.<e>.gate_proj` / `up_proj`; a
  shared A (lora.shared_expert_a) is written for every expert.
* Trainable parameters that are not LoRA factors (depth-mix residual weights) are
  written whole under `base_model.model.<name>` and listed in adapter_config.json's
  `hylora_whole_tensors` (PEFT itself ignores them).

`merge=True` also writes `merged/`: the full model in the HF layout with every adapted
weight replaced by base + scale * B A (hylora.io.hf_weights.save), loadable as base weights.
A packed (quantized) base merges only into a bf16 copy, asked for with `merge_dequantized`
(`checkpoint.merge_dequantized`); without it the merge is refused before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import jax
import numpy as np
from safetensors.numpy import save_file

from hylora.io import hf_weights
from hylora.core.config import Config
from hylora.io.hf_names import Leaf, plan

PEFT_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def _module(name: str) -> str:
  return name.rsplit(".", 1)[0]  # "...q_proj.weight" -> "...q_proj"


def adapter_tensors(cfg: Config, frozen: dict, lora: dict) -> Iterator[tuple[str, np.ndarray]]:
  """(PEFT name, array) for every adapter factor and every trainable non-adapter leaf
  (`frozen` gives the names and, for routed experts, the slot placement)."""
  adapters = hf_weights.flat_paths(lora)
  frozen_flat = hf_weights.flat_paths(frozen)
  for leaf in plan(cfg, frozen):
    pair = hf_weights.adapter_paths(leaf) if not leaf.tensor.fill else None
    if not pair or pair[0] not in adapters:
      continue
    a, b = adapters[pair[0]], adapters[pair[1]]
    a_dims = a.ndim - leaf.tensor.in_dims - 1  # fewer than the leaf's: A shared by experts
    read_a = hf_weights.item_reader(a, a_dims)
    read_b = hf_weights.item_reader(b, leaf.stack_dims)
    slot = hf_weights.expert_slots(leaf, frozen_flat)
    for index, names in leaf.items():
      index = slot(index)
      yield from _factors(leaf, names, read_a(index[:a_dims]), read_b(index))
  extras = hf_weights.non_adapters(lora)
  for leaf in plan(cfg, extras):
    read = hf_weights.item_reader(hf_weights.flat_paths(extras)[leaf.path], leaf.stack_dims)
    for index, names in leaf.items():
      for name, tensor in zip(names, hf_weights.to_tensors(leaf, read(index))):
        yield PEFT_PREFIX + name, tensor


def _factors(leaf: Leaf, names, a: np.ndarray, b: np.ndarray):
  """One slice's A [*in, r] and B [r, *out] as PEFT tensors (B split for fused weights)."""
  rank = a.shape[-1]
  lora_a = np.ascontiguousarray(a.reshape(-1, rank).T.astype(np.float32))  # [r, in]
  lora_b = b.reshape(rank, -1).T.astype(np.float32)  # [out, r]
  for name, part in zip(names, np.split(lora_b, len(names), axis=0)):
    module = PEFT_PREFIX + _module(name)
    yield f"{module}.lora_A.weight", lora_a
    yield f"{module}.lora_B.weight", np.ascontiguousarray(part)


def adapter_config(cfg: Config, module_names: list[str], whole: list[str]) -> dict:
  targets = sorted({m.rsplit(".", 1)[-1] for m in module_names})
  return {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "r": cfg.lora.rank,
      "lora_alpha": cfg.lora.alpha,
      "lora_dropout": cfg.lora.dropout,
      "target_modules": targets,
      "bias": "none",
      "fan_in_fan_out": False,
      "use_rslora": False,
      "use_dora": False,
      "inference_mode": True,
      "modules_to_save": None,
      "base_model_name_or_path": cfg.checkpoint.base_weights or None,
      # trainable tensors that are not LoRA factors, stored whole (see the module doc)
      "hylora_whole_tensors": whole,
  }


def export(directory: str | Path, cfg: Config, frozen: dict, lora: dict, merge: bool = False,
           max_shard_bytes: int = 4 << 30, merge_dequantized: bool | None = None) -> Path:
  """Writes the adapter (and with `merge` the merged model under `merged/`, in bf16 for a
  packed base when `merge_dequantized`, default `checkpoint.merge_dequantized`); every
  process must call it (the per-slice gathers are collectives), process 0 writes."""
  if merge_dequantized is None:
    merge_dequantized = cfg.checkpoint.merge_dequantized
  if merge:
    hf_weights.check_merge(cfg, frozen, merge_dequantized)
  out = Path(directory)
  tensors = dict(adapter_tensors(cfg, frozen, lora))
  if jax.process_index() == 0:
    out.mkdir(parents=True, exist_ok=True)
    modules = sorted(
        {n[len(PEFT_PREFIX):].rsplit(".lora_", 1)[0] for n in tensors if ".lora_" in n})
    whole = sorted(n[len(PEFT_PREFIX):] for n in tensors if ".lora_" not in n)
    save_file(tensors, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    config = adapter_config(cfg, modules, whole)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
  if merge:
    hf_weights.save(out / "merged", cfg, frozen, lora, merge=True, max_shard_bytes=max_shard_bytes,
                    merge_dequantized=merge_dequantized)
  return out

"""Sharded random parameter trees built on the host (no compiled init): base weights and
adapters for the weights/export tests."""

from __future__ import annotations

import json

import jax
import numpy as np
from safetensors import safe_open

from hylora.io import hf_weights
from hylora.train import state as st
from meshes.mesh import build_mesh


def random_tree(abstract: dict, seed: int, std: float = 0.05) -> dict:
  """Arrays like `abstract` (ShapeDtypeStructs with shardings): normal floats, and the
  identity expert placement for integer leaves."""
  rng = np.random.default_rng(seed)

  def one(x):
    if np.issubdtype(x.dtype, np.integer):
      value = np.broadcast_to(np.arange(x.shape[-1]), x.shape).astype(x.dtype)
    else:
      value = (rng.standard_normal(x.shape) * std).astype(x.dtype)
    return jax.device_put(value, x.sharding)

  return jax.tree.map(one, abstract)


def model_and_trees(cfg, seed: int = 0):
  """(mesh, parts, lora, frozen) with random values (B factors non-zero)."""
  mesh = build_mesh(cfg.mesh)
  parts = st.model_parts(cfg)
  lora_abstract, frozen_abstract = st.abstract_arrays(parts, mesh)
  return (mesh, parts, random_tree(lora_abstract, seed + 1), random_tree(frozen_abstract, seed))


def host(tree) -> dict:
  return jax.tree.map(np.asarray, tree)


def read_folder(path) -> dict[str, np.ndarray]:
  """Every tensor of a sharded safetensors folder (its index names the shard of each)."""
  index = json.loads((path / hf_weights.INDEX_FILE).read_text())["weight_map"]
  out = {}
  for name, file in index.items():
    with safe_open(str(path / file), framework="numpy") as f:
      out[name] = f.get_tensor(name)
  return out

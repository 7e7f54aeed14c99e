"""What the memory planner weighs, per device: each save point's bytes and forward FLOPs
for a layer, the tokens of one micro-batch, and the resident state (frozen weights,
adapters and their optimizer state, one layer period's gathered weights).

Sizes and FLOPs come from the architecture's description (`hylora.core.architecture`);
the resident state from the activation and parameter rules of `meshes.rules` on an abstract mesh
(no devices needed). `hylora.plan.remat_planner` turns them into a plan.
"""

from __future__ import annotations

import functools
import math
import types
from typing import Mapping

from meshes import logical_axes as ax
from hylora.core.architecture import Work, ffn_block, mixer_block, stacked_position
from hylora.core.config import Config
from hylora.core.errors import ConfigError

# ---- sizes and FLOPs of the save points ------------------------------------------------


def layer_work(cfg: Config, mixer: str, ffn: str, n: int) -> dict[str, Work]:
  """{save point: its summed Work} of one layer of these kinds for n tokens on one device,
  as the architecture's description (hylora.core.architecture) states it; FLOPs as the
  chosen implementations execute them."""
  out: dict[str, Work] = {}
  for w in mixer_block(mixer).work(cfg, n) + ffn_block(ffn).work(cfg, n):
    had = out.get(w.save_point, Work(w.save_point))
    out[w.save_point] = Work(w.save_point, had.nbytes + w.nbytes,
                             had.forward + w.forward * w.executed,
                             had.backward + w.backward * w.executed)
  return out


def layer_save_points(cfg: Config, mixer: str, ffn: str, n: int) -> dict[str, tuple[int, float]]:
  """{name: (bytes, executed forward FLOPs)} of one layer for n tokens on one device."""
  return {name: (w.nbytes, w.forward) for name, w in layer_work(cfg, mixer, ffn, n).items()}


# ---- the device's resident state -------------------------------------------------------


def _fake_mesh(mesh_shape) -> types.SimpleNamespace:
  if isinstance(mesh_shape, Mapping):
    shape = dict(mesh_shape)
  else:
    fsdp, expert = mesh_shape
    shape = {"fsdp": int(fsdp), "expert": int(expert)}
  if set(shape) != {"fsdp", "expert"} or min(shape.values()) < 1:
    raise ConfigError(f"mesh_shape: expected (fsdp, expert) sizes >= 1, got {mesh_shape!r}")
  return types.SimpleNamespace(shape=shape)


def _shard_factor(spec, mesh) -> int:
  factor = 1
  for entry in spec:
    for axis in (entry if isinstance(entry, tuple) else (entry,)):
      if axis is not None:
        factor *= mesh.shape[axis]
  return factor


def tokens_per_device(cfg: Config, mesh_shape) -> int:
  """Tokens of one micro-batch on one device: the shard of a micro-batch's [rows, seq]
  that the activation rules give each device (rows, and the sequence when the rows
  cannot take every device), as the model's sharding constraints place it."""
  from meshes.rules import ACTIVATION_RULES, logical_to_spec
  mesh = _fake_mesh(mesh_shape)
  t = cfg.train
  rows = max(1, t.batch_size // t.grad_accum)
  spec = logical_to_spec((ax.BATCH, ax.SEQ), (rows, t.seq_len), mesh, ACTIVATION_RULES)
  return max(1, math.ceil(rows * t.seq_len / _shard_factor(spec, mesh)))


def dispatch_buffer_bytes(cfg: Config, mesh_shape) -> int:
  """One MoE layer's all-to-all round buffers per device when routed experts run per
  device (hylora.model.ffn.expert_parallel.round_buffer_bytes); 0 otherwise."""
  from hylora.model.ffn.dispatchers import resolved_dispatcher
  from hylora.model.ffn.expert_parallel import round_buffer_bytes

  m = cfg.model
  mesh = _fake_mesh(mesh_shape)
  devices = math.prod(mesh.shape.values())
  if (resolved_dispatcher(m.moe.dispatch, devices) != "ep_alltoall" or
      all(ffn not in ("moe", "latent_moe") for _, ffn in m.layer_kinds())):
    return 0
  width = m.moe.latent_dim if m.ffn == "latent_moe" else m.d_model
  per_chunk = round_buffer_bytes(m.moe, width, tokens_per_device(cfg, mesh_shape),
                                 mesh.shape["expert"])
  return m.moe.overlap_chunks * per_chunk


def resident_bytes(cfg: Config, mesh_shape) -> tuple[int, int]:
  """(frozen weights + LoRA state, largest layer period's gathered weights) per device."""
  mesh = _fake_mesh(mesh_shape)
  return _resident_bytes(cfg.model, cfg.lora, cfg.mesh.min_shard_size,
                         tuple(sorted(mesh.shape.items())))


@functools.lru_cache(maxsize=16)  # building the abstract model takes seconds at full size
def _resident_bytes(model, lora, floor: int, mesh_items) -> tuple[int, int]:
  import jax
  from flax import nnx
  from hylora.train.state import model_parts
  from meshes.rules import PARAM_RULES, follow_spec, logical_to_spec

  mesh = types.SimpleNamespace(shape=dict(mesh_items))
  parts = model_parts(Config(model=model, lora=lora))
  is_var = lambda x: isinstance(x, nnx.Variable)

  def walk(template, per_element):
    total, periods = 0, {}
    for path, var in jax.tree_util.tree_flatten_with_path(template, is_leaf=is_var)[0]:
      names = var.get_metadata().get("out_sharding") if math.prod(var.shape) >= floor else None
      value = var.get_value()
      # a packed weight: its codes, and their scales sharded like them (meshes.rules)
      arrays = [value] if hasattr(value, "dtype") else jax.tree.leaves(value)
      first = logical_to_spec(names, tuple(arrays[0].shape), mesh, PARAM_RULES)
      for array in arrays:
        shape = tuple(array.shape)
        spec = follow_spec(first, shape, mesh)
        nbytes = math.prod(shape) * per_element(array)
        total += nbytes // _shard_factor(spec, mesh)
        if names and ax.LAYERS in names:  # a scanned segment: gathered one period at a time
          keys = tuple(getattr(p, "key", getattr(p, "idx", None)) for p in path)
          stacked = stacked_position(keys)
          segment = stacked[0] if stacked is not None else 0
          local = nbytes // shape[names.index(ax.LAYERS)]
          if ax.EXP in names:
            local //= mesh.shape["expert"]
          periods[segment] = periods.get(segment, 0) + local
    return total, max(periods.values(), default=0)

  frozen, gathered = walk(parts.frozen_template, lambda a: a.dtype.itemsize)
  # adapters fp32 + their gradient + the accumulated gradient + two Adam moments
  lora, _ = walk(parts.lora_template, lambda v: 4 * 5)
  return frozen + lora, gathered

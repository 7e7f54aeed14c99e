"""What the memory planner weighs, per device: each save point's bytes and forward FLOPs
for a layer, the tokens of one micro-batch, and the resident state (frozen weights,
adapters and their optimizer state, one layer period's gathered weights).

Sizes follow the model's code: the save points of `hylora.core.save_points`, the Pallas kernels'
residuals, the activation and parameter rules of `meshes.rules` on an abstract mesh
(no devices needed). `hylora.plan.remat_planner` turns them into a plan.
"""

from __future__ import annotations

import functools
import math
import types
from typing import Mapping

from meshes import logical_axes as ax
from hylora.core import save_points
from hylora.core.config import Config
from hylora.core.errors import ConfigError


# ---- sizes and FLOPs of the save points ------------------------------------------------


def _sparse_attention_is_masked_dense(cfg: Config, n: int) -> bool:
  """Whether the sparse layers run masked dense attention on GPU (the planner's target):
  chosen by name, or by `auto` through pallas_kernels/sparse_attention/by_density.py."""
  choice = cfg.kernels.sparse_attention
  if choice == "masked_dense":
    return True
  if choice not in ("auto", "by_density"):
    return False
  from pallas_kernels.sparse_attention.by_density import prefers_dense
  sa, seq = cfg.model.sparse_attention, cfg.train.seq_len
  rows = max(1, n // seq)
  return prefers_dense((rows, seq, sa.q_heads, sa.head_dim),
                       (rows, seq, sa.kv_heads, sa.head_dim), sa.top_k, "bfloat16")


def layer_save_points(cfg: Config, mixer: str, ffn: str, n: int) -> dict[str, tuple[int, float]]:
  """{name: (bytes, forward FLOPs)} of one layer for n tokens on one device."""
  m, lora = cfg.model, cfg.lora
  d, r, seq = m.d_model, lora.rank, cfg.train.seq_len
  out: dict[str, list[float]] = {}

  def add(name, nbytes, flops=0.0):
    entry = out.setdefault(name, [0, 0.0])
    entry[0] += int(nbytes)
    entry[1] += float(flops)

  def linear(name, lora_name, fan_in, fan_out, save_as, dtype_bytes=2):
    add(save_as, n * fan_out * dtype_bytes, 2.0 * n * fan_in * fan_out)
    if lora is not None and _targets(cfg, lora_name):
      add(save_points.LORA_A, n * r * 2, 2.0 * n * fan_in * r + 2.0 * n * r * fan_out)

  add(save_points.LAYER_INPUT, n * d * 2)
  add(save_points.MIXER_NORM, n * d * 2, 4.0 * n * d)
  if mixer == "linear":
    la = m.linear_attention
    hd = la.heads * la.head_dim
    for name in ("q", "k", "v"):
      linear(name, name, d, hd, save_points.QKV)
    gate_flops = 2.0 * n * (d * la.gate_rank + la.gate_rank * hd)
    gate_flops += 2.0 * n * (d * la.output_gate_rank + la.output_gate_rank * hd)
    gate_bytes = 2 * n * hd * 4  # decay and output gate, fp32
    if la.delta_rule:
      gate_flops += 2.0 * n * d * la.heads
      gate_bytes += n * la.heads * 4
    add(save_points.GATES, gate_bytes, gate_flops)
    # chunked form: intra-chunk [C, C] products and the [dk, dv] state per chunk
    c, dh = la.chunk_size, la.head_dim
    per_head = 4 * c * dh + (8 if la.delta_rule else 4) * dh ** 2
    # + the Pallas kernels' residuals (pallas_kernels/residuals.py), per token and head:
    # KDA qg, kg, w, v_new, A_qk, (I + A_kk)^-1 and the chunk states (bf16); GLA its
    # in-chunk scores (fp32)
    kept = 2 * (4 * dh + 2 * c + dh * dh // c) if la.delta_rule else 4 * c
    add(save_points.ATTENTION, n * hd * 2 + n * la.heads * kept, float(n) * la.heads * per_head)
    linear("o", "o", hd, d, save_points.MIXER_OUT)
  else:
    sa = m.sparse_attention
    q_dim, kv_dim = sa.q_heads * sa.head_dim, sa.kv_heads * sa.head_dim
    linear("q", "q", d, q_dim, save_points.QKV)
    linear("k", "k", d, kv_dim, save_points.QKV)
    linear("v", "v", d, kv_dim, save_points.QKV)
    ih, ihd = sa.index_heads, sa.index_head_dim
    add(save_points.INDEXER, n * (ih * ihd * 2 + ihd * 2 + ih * 4),
        2.0 * n * (d * sa.index_q_rank + sa.index_q_rank * ih * ihd + d * ihd + d * ih))
    # indexer scores over the causal keys (on average half the row) and the top-k pick
    add(save_points.TOPK, n * sa.top_k * 4, float(n) * seq * ih * ihd)
    # the output, and the kernel's residuals: the log-sum-exp (its output residual is the
    # same buffer as the output); masked dense attention also keeps the selection as a
    # bf16 bias, 2 bytes per (query, key), and computes the causal half of all pairs
    keys = min(sa.top_k, seq)
    extra = 0
    if _sparse_attention_is_masked_dense(cfg, n):
      keys, extra = seq // 2, n * seq * 2
    add(save_points.ATTENTION, n * q_dim * 2 + n * sa.q_heads * 4 + extra,
        4.0 * n * sa.q_heads * keys * sa.head_dim)
    linear("o", "o", q_dim, d, save_points.MIXER_OUT)
  add(save_points.FFN_NORM, n * d * 2, 4.0 * n * d)
  if ffn == "dense":
    f = m.dense_ffn
    linear("gate_up", "gate_up", d, 2 * f, save_points.MLP_GATE_UP)
    linear("down", "down", f, d, save_points.MLP_DOWN)
  else:
    moe = m.moe
    f, pairs = moe.expert_ffn, n * moe.top_k
    if moe.dispatch == "ep_alltoall" and moe.capacity_factor > 0:
      # the experts compute every row of the capacity-sized receive buffers
      pairs = math.ceil(pairs * max(1.0, moe.capacity_factor))
    add(save_points.ROUTER, n * moe.experts * 4, 2.0 * n * d * moe.experts)
    add(save_points.EXPERT_INPUT, pairs * d * 2)
    add(save_points.EXPERT_GATE_UP, pairs * 2 * f * 2, 2.0 * pairs * d * 2 * f)
    if _targets(cfg, "gate_up"):
      add(save_points.EXPERT_GATE_UP, 0, 2.0 * pairs * r * (d + 2 * f))
    add(save_points.EXPERT_DOWN, pairs * d * 2, 2.0 * pairs * f * d)
    if moe.shared_experts > 0:
      fs = f * moe.shared_experts
      linear("gate_up", "gate_up", d, 2 * fs, save_points.MLP_GATE_UP)
      linear("down", "down", fs, d, save_points.MLP_DOWN)
  return {name: (int(v[0]), v[1]) for name, v in out.items()}


def _targets(cfg: Config, name: str) -> bool:
  from hylora.model.lora import wants_lora
  return wants_lora(cfg.lora, name)


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
  from meshes.rules import PARAM_RULES, logical_to_spec

  mesh = types.SimpleNamespace(shape=dict(mesh_items))
  parts = model_parts(Config(model=model, lora=lora))
  is_var = lambda x: isinstance(x, nnx.Variable)

  def walk(template, per_element):
    total, periods = 0, {}
    for path, var in jax.tree_util.tree_flatten_with_path(template, is_leaf=is_var)[0]:
      shape = tuple(var.shape)
      names = var.get_metadata().get("out_sharding") if math.prod(shape) >= floor else None
      spec = logical_to_spec(names, shape, mesh, PARAM_RULES)
      nbytes = math.prod(shape) * per_element(var)
      total += nbytes // _shard_factor(spec, mesh)
      if names and ax.LAYERS in names:  # a scanned segment: gathered one period at a time
        keys = [getattr(p, "key", getattr(p, "idx", None)) for p in path]
        segment = keys[keys.index("segments") + 1] if "segments" in keys else 0
        local = nbytes // shape[names.index(ax.LAYERS)]
        if ax.EXP in names:
          local //= mesh.shape["expert"]
        periods[segment] = periods.get(segment, 0) + local
    return total, max(periods.values(), default=0)

  frozen, gathered = walk(parts.frozen_template, lambda v: v.dtype.itemsize)
  # adapters fp32 + their gradient + the accumulated gradient + two Adam moments
  lora, _ = walk(parts.lora_template, lambda v: 4 * 5)
  return frozen + lora, gathered

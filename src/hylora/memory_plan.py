"""The memory planner: which save points stay in HBM, which go to host, which are recomputed.

An analytic model per device: every save point of `hylora.remat` gets its bytes (summed
over the layers, one micro-batch) and the time to recompute it (its forward FLOPs at the
matmul rate plus its bytes at the HBM rate). The peak is the resident state (frozen
weights, adapters, gradients, Adam moments) + one layer period's gathered weights + the
saved residuals kept in HBM (with every layer's input: the policy wraps each layer) + the
working set of one layer's backward + the loss. Host
copies run at `host_bandwidth` each way; the share `host_overlap` of them hides behind
compute (device-to-host behind the forward, host-to-device behind the backward), the
rest is added. XLA's compiled peak can still differ from the estimate:
`replan_after_compile` plans again with the measured error taken off the budget.

The search starts from "recompute everything" and moves one save point at a time to the
tier that lowers the predicted step time most per added HBM byte while the plan still
fits, until no move helps: deterministic, and a tighter budget can only leave more
recomputed or offloaded. `plan_memory(...).policy_config()` is the `MemoryConfig`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import Mapping

from hylora import axes as ax
from hylora import memory, remat
from hylora.config import Config, MemoryConfig
from hylora.errors import ConfigError

GB = 1e9
TIERS = ("hbm", "host", "recompute")


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One accelerator as the plan sees it (defaults: H200, `../shared/docs/anchors.md`)."""

  matmul_flops: float = 600e12  # bf16 FLOP/s reached by large matmuls
  hbm_bandwidth: float = 2.8e12  # bytes/s of an elementwise pass (read + write)
  host_bandwidth: float = 52e9  # bytes/s device <-> pinned host, each way
  # Share of the host copies' time hidden behind compute. Measured on the H200 (gpu-1, 8
  # layers, 16K x 2, docs/performance.md): offloading 35.8 GB cost ~0.66 s of exposed
  # time, half of the two ways' 1.38 s.
  host_overlap: float = 0.5
  host_memory_bytes: float = 200e9  # pinned host memory one device may fill


H200 = Hardware()


@dataclasses.dataclass(frozen=True)
class SavePoint:
  """One named save point, over all layers of one micro-batch on one device."""

  name: str
  bytes: int  # saved size summed over the layers that produce it
  recompute_flops: float  # forward FLOPs to produce it again, all layers, one micro-batch
  recompute_seconds: float  # per optimizer step (all micro-batches)
  tier: str  # "hbm", "host" or "recompute"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  policy: str  # the MemoryConfig.remat this plan describes
  hbm_names: tuple[str, ...]
  host_names: tuple[str, ...]
  recompute_names: tuple[str, ...]
  save_points: tuple[SavePoint, ...]
  tokens_per_device: int  # one micro-batch
  micro_batches: int
  layers: int
  device_memory_bytes: int
  host_memory_bytes: int
  resident_bytes: int  # frozen weights + adapters + gradients + optimizer moments
  gathered_weight_bytes: int  # one layer period's weights after the FSDP all-gather
  saved_hbm_bytes: int  # residuals kept in device memory, with every layer's input
  working_bytes: int  # one layer's backward: its activations and their cotangents
  loss_bytes: int  # final hidden state, its gradient, the chunked cross-entropy blocks
  host_bytes: int  # residuals offloaded to pinned host memory
  predicted_peak_bytes: int
  compute_seconds: float  # forward + backward, no recomputation
  recompute_seconds: float
  exposed_transfer_seconds: float  # host copies that do not hide behind compute
  predicted_step_seconds: float
  fits: bool
  working_compiled: bool = False  # working_bytes from compiled layer parts, not the estimate

  def policy_config(self) -> MemoryConfig:
    if self.policy != "tiered":
      return memory.check(MemoryConfig(remat=self.policy))
    return memory.check(MemoryConfig(remat="tiered", hbm_names=self.hbm_names,
                                     host_names=self.host_names))

  def table(self) -> str:
    return format_table(self)


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
      add(remat.LORA_A, n * r * 2, 2.0 * n * fan_in * r + 2.0 * n * r * fan_out)

  add(remat.LAYER_INPUT, n * d * 2)
  add(remat.MIXER_NORM, n * d * 2, 4.0 * n * d)
  if mixer == "linear":
    la = m.linear_attention
    hd = la.heads * la.head_dim
    for name in ("q", "k", "v"):
      linear(name, name, d, hd, remat.QKV)
    gate_flops = 2.0 * n * (d * la.gate_rank + la.gate_rank * hd)
    gate_flops += 2.0 * n * (d * la.output_gate_rank + la.output_gate_rank * hd)
    gate_bytes = 2 * n * hd * 4  # decay and output gate, fp32
    if la.delta_rule:
      gate_flops += 2.0 * n * d * la.heads
      gate_bytes += n * la.heads * 4
    add(remat.GATES, gate_bytes, gate_flops)
    # chunked form: intra-chunk [C, C] products and the [dk, dv] state per chunk
    c, dh = la.chunk_size, la.head_dim
    per_head = 4 * c * dh + (8 if la.delta_rule else 4) * dh ** 2
    # + the Pallas kernels' residuals (pallas_kernels/residuals.py), per token and head:
    # KDA qg, kg, w, v_new, A_qk, (I + A_kk)^-1 and the chunk states (bf16); GLA its
    # in-chunk scores (fp32)
    kept = 2 * (4 * dh + 2 * c + dh * dh // c) if la.delta_rule else 4 * c
    add(remat.ATTENTION, n * hd * 2 + n * la.heads * kept, float(n) * la.heads * per_head)
    linear("o", "o", hd, d, remat.MIXER_OUT)
  else:
    sa = m.sparse_attention
    q_dim, kv_dim = sa.q_heads * sa.head_dim, sa.kv_heads * sa.head_dim
    linear("q", "q", d, q_dim, remat.QKV)
    linear("k", "k", d, kv_dim, remat.QKV)
    linear("v", "v", d, kv_dim, remat.QKV)
    ih, ihd = sa.index_heads, sa.index_head_dim
    add(remat.INDEXER, n * (ih * ihd * 2 + ihd * 2 + ih * 4),
        2.0 * n * (d * sa.index_q_rank + sa.index_q_rank * ih * ihd + d * ihd + d * ih))
    # indexer scores over the causal keys (on average half the row) and the top-k pick
    add(remat.TOPK, n * sa.top_k * 4, float(n) * seq * ih * ihd)
    # the output, and the kernel's residuals: the log-sum-exp (its output residual is the
    # same buffer as the output); masked dense attention also keeps the selection as a
    # bf16 bias, 2 bytes per (query, key), and computes the causal half of all pairs
    keys = min(sa.top_k, seq)
    extra = 0
    if _sparse_attention_is_masked_dense(cfg, n):
      keys, extra = seq // 2, n * seq * 2
    add(remat.ATTENTION, n * q_dim * 2 + n * sa.q_heads * 4 + extra,
        4.0 * n * sa.q_heads * keys * sa.head_dim)
    linear("o", "o", q_dim, d, remat.MIXER_OUT)
  add(remat.FFN_NORM, n * d * 2, 4.0 * n * d)
  if ffn == "dense":
    f = m.dense_ffn
    linear("gate_up", "gate_up", d, 2 * f, remat.MLP_GATE_UP)
    linear("down", "down", f, d, remat.MLP_DOWN)
  else:
    moe = m.moe
    f, pairs = moe.expert_ffn, n * moe.top_k
    if moe.dispatch == "ep_alltoall" and moe.capacity_factor > 0:
      # the experts compute every row of the capacity-sized receive buffers
      pairs = math.ceil(pairs * max(1.0, moe.capacity_factor))
    add(remat.ROUTER, n * moe.experts * 4, 2.0 * n * d * moe.experts)
    add(remat.EXPERT_INPUT, pairs * d * 2)
    add(remat.EXPERT_GATE_UP, pairs * 2 * f * 2, 2.0 * pairs * d * 2 * f)
    if _targets(cfg, "gate_up"):
      add(remat.EXPERT_GATE_UP, 0, 2.0 * pairs * r * (d + 2 * f))
    add(remat.EXPERT_DOWN, pairs * d * 2, 2.0 * pairs * f * d)
    if moe.shared_experts > 0:
      fs = f * moe.shared_experts
      linear("gate_up", "gate_up", d, 2 * fs, remat.MLP_GATE_UP)
      linear("down", "down", fs, d, remat.MLP_DOWN)
  return {name: (int(v[0]), v[1]) for name, v in out.items()}


def _targets(cfg: Config, name: str) -> bool:
  from hylora.model.lora import wants_lora
  return wants_lora(cfg.lora, name)


# Backward FLOPs per forward FLOP: frozen matmuls need only the input gradient; the
# attention cores' backward is about twice their forward; top-k is not differentiated.
_BACKWARD_RATIO = {remat.ATTENTION: 2.0, remat.TOPK: 0.0, remat.LORA_A: 2.0}


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


# ---- evaluating and searching ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Model:
  cfg: Config
  hw: Hardware
  n: int
  micro: int
  layers: int
  points: dict  # name -> (bytes, fwd flops), all layers
  layer_bytes: int  # all save points of the largest layer
  forward_seconds: float
  backward_seconds: float
  resident: int
  gathered: int
  loss_bytes: int
  device_memory: int
  host_memory: int
  measured_working: int | None = None  # compiled layer parts (hylora.layer_memory)

  def recompute_seconds(self, name: str) -> float:
    nbytes, flops = self.points[name]
    return self.micro * (flops / self.hw.matmul_flops + 2 * nbytes / self.hw.hbm_bandwidth)

  def evaluate(self, tiers: Mapping[str, str], policy: str = "tiered") -> MemoryPlan:
    hbm = tuple(n for n in self.points if tiers[n] == "hbm")
    host = tuple(n for n in self.points if tiers[n] == "host")
    rec = tuple(n for n in self.points if tiers[n] == "recompute")
    d = self.cfg.model.d_model
    # each layer is checkpointed on its own (hylora.model.stack): its input is kept
    carries = 0 if remat.LAYER_INPUT in hbm else self.layers * self.n * d * 2
    saved = sum(self.points[n][0] for n in hbm) + carries
    host_bytes = sum(self.points[n][0] for n in host)
    layer = self.layer_bytes if self.measured_working is None else self.measured_working
    working = layer + 3 * self.n * d * 4  # + fp32 cotangents of the stream
    peak = self.resident + self.gathered + saved + working + self.loss_bytes
    recompute = sum(self.recompute_seconds(n) for n in rec)
    copy = self.micro * host_bytes / self.hw.host_bandwidth  # one way
    hidden = self.hw.host_overlap * copy
    step = (max(self.forward_seconds, hidden) + max(self.backward_seconds + recompute, hidden)
            + 2 * (copy - hidden))
    exposed = step - self.forward_seconds - self.backward_seconds - recompute
    rows = tuple(SavePoint(n, self.points[n][0], self.points[n][1] * 1.0,
                           self.recompute_seconds(n), tiers[n]) for n in self.points)
    return MemoryPlan(
        policy=policy, hbm_names=hbm, host_names=host, recompute_names=rec, save_points=rows,
        tokens_per_device=self.n, micro_batches=self.micro, layers=self.layers,
        device_memory_bytes=int(self.device_memory), host_memory_bytes=int(self.host_memory),
        resident_bytes=self.resident, gathered_weight_bytes=self.gathered,
        saved_hbm_bytes=saved, working_bytes=working, loss_bytes=self.loss_bytes,
        host_bytes=host_bytes, predicted_peak_bytes=int(peak),
        compute_seconds=self.forward_seconds + self.backward_seconds,
        recompute_seconds=recompute, exposed_transfer_seconds=exposed if exposed > 1e-9 else 0.0,
        predicted_step_seconds=step,
        fits=bool(peak <= self.device_memory and host_bytes <= self.host_memory),
        working_compiled=self.measured_working is not None)


def _build(cfg: Config, mesh_shape, device_memory_bytes, hw: Hardware,
           working_bytes: int | None = None) -> _Model:
  if not device_memory_bytes or device_memory_bytes <= 0:
    raise ConfigError(f"device_memory_bytes: must be > 0, got {device_memory_bytes!r}")
  from pallas_kernels.cross_entropy.chunked_cross_entropy import (DEFAULT_LOGITS_CHUNK,
                                                                  DEFAULT_TOKEN_CHUNK)
  n = tokens_per_device(cfg, mesh_shape)
  m = cfg.model
  kinds = m.layer_kinds()
  points: dict[str, list[float]] = {name: [0, 0.0] for name in remat.ALL}
  forward = backward = 0.0
  layer_bytes = max(sum(nbytes for nbytes, _ in layer_save_points(cfg, mixer, ffn, n).values())
                    for mixer, ffn in set(kinds))
  for mixer, ffn in kinds:
    for name, (nbytes, flops) in layer_save_points(cfg, mixer, ffn, n).items():
      points[name][0] += nbytes
      points[name][1] += flops
      forward += flops
      backward += flops * _BACKWARD_RATIO.get(name, 1.0)
  head = 2.0 * n * m.d_model * m.vocab_size  # the LM head: forward, recomputed, input grad
  micro = cfg.train.grad_accum
  resident, gathered = resident_bytes(cfg, mesh_shape)
  loss_bytes = (n * m.d_model * 10
                + (2 * DEFAULT_TOKEN_CHUNK + 4 * DEFAULT_LOGITS_CHUNK) * m.vocab_size)
  kept = {name: (int(v[0]), v[1]) for name, v in points.items() if v[0] > 0}
  return _Model(cfg=cfg, hw=hw, n=n, micro=micro, layers=m.layers,
                points=kept, layer_bytes=layer_bytes,
                forward_seconds=micro * (forward + head) / hw.matmul_flops,
                backward_seconds=micro * (backward + 2 * head) / hw.matmul_flops,
                resident=resident, gathered=gathered, loss_bytes=loss_bytes,
                device_memory=int(device_memory_bytes), host_memory=int(hw.host_memory_bytes),
                measured_working=working_bytes)


def _search(model: _Model) -> MemoryPlan:
  tiers = {name: "recompute" for name in model.points}
  best = model.evaluate(tiers)
  if not best.fits:
    return best  # nothing fits: the all-recompute plan says by how much
  while True:
    choice = None
    for name in model.points:  # fixed order: deterministic
      for tier in TIERS:
        if tier == tiers[name]:
          continue
        trial = model.evaluate({**tiers, name: tier})
        gain = best.predicted_step_seconds - trial.predicted_step_seconds
        if not trial.fits or gain <= 1e-12:
          continue
        added = trial.predicted_peak_bytes - best.predicted_peak_bytes
        score = gain / max(added, 1)  # time saved per HBM byte spent
        if choice is None or score > choice[0]:
          choice = (score, name, tier, trial)
    if choice is None:
      return best
    _, name, tier, best = choice
    tiers[name] = tier


def plan_memory(cfg: Config, mesh_shape, device_memory_bytes: float, *,
                hardware: Hardware = H200, working_bytes: int | None = None) -> MemoryPlan:
  """The tiered policy with the lowest predicted step time that fits the budget.

  `working_bytes`: one layer's backward working set as compiled on the target backend
  (`hylora.layer_memory.measured_working_bytes`); without it, the analytic estimate (the
  largest layer's save points), which is low by 2-3x for the attention and MoE parts."""
  return _search(_build(cfg, mesh_shape, device_memory_bytes, hardware, working_bytes))


def replan_after_compile(cfg: Config, mesh_shape, device_memory_bytes: float,
                         plan: MemoryPlan, compiled_peak_bytes: float, *,
                         hardware: Hardware = H200, working_bytes: int | None = None,
                         slack: float = 0.01) -> MemoryPlan:
  """Plan again after XLA compiled `plan` to `compiled_peak_bytes`.

  The planner's estimate misses what XLA adds (staging of host copies, fusion temporaries,
  its own schedule); that error is taken to carry over to the next plan, so the planner is
  given the budget minus the error and `slack` of the budget. Call it while the compiled
  peak exceeds the budget; the result says `fits=False` when nothing does."""
  if compiled_peak_bytes <= 0:
    raise ConfigError(f"compiled_peak_bytes: must be > 0, got {compiled_peak_bytes!r}")
  error = max(compiled_peak_bytes - plan.predicted_peak_bytes, 0)
  planning = device_memory_bytes - error - slack * device_memory_bytes
  if planning <= 0:
    raise ConfigError(f"XLA's peak ({compiled_peak_bytes / 1e9:.1f} GB) is over the planner's "
                      f"({plan.predicted_peak_bytes / 1e9:.1f} GB) by more than the budget")
  return plan_memory(cfg, mesh_shape, planning, hardware=hardware, working_bytes=working_bytes)


def estimate_policy(cfg: Config, mesh_shape, device_memory_bytes: float,
                    policy: MemoryConfig | None = None, *, hardware: Hardware = H200,
                    working_bytes: int | None = None) -> MemoryPlan:
  """The same model's prediction for a given policy (default: cfg.memory), as on a GPU."""
  policy = memory.check(policy or cfg.memory)
  model = _build(cfg, mesh_shape, device_memory_bytes, hardware, working_bytes)
  hbm, host = memory.tiers(policy, backend="gpu")
  tiers = {n: "hbm" if n in hbm else "host" if n in host else "recompute" for n in model.points}
  return model.evaluate(tiers, policy.remat)


# ---- the table ---------------------------------------------------------------------------


def format_table(plan: MemoryPlan) -> str:
  lines = [f"memory plan ({plan.policy}): {plan.layers} layers, {plan.tokens_per_device} tokens "
           f"per device x {plan.micro_batches} micro-batch(es); budget "
           f"{_size(plan.device_memory_bytes)} device, {_size(plan.host_memory_bytes)} host",
           f"  {'save point':<16} {'all layers':>12} {'recompute ms':>13}  tier"]
  for p in plan.save_points:
    lines.append(f"  {p.name:<16} {_size(p.bytes):>12} {p.recompute_seconds * 1e3:>13.3g}  "
                 f"{p.tier}")
  parts = (("resident (weights, adapters, optimizer)", plan.resident_bytes),
           ("gathered weights of one period", plan.gathered_weight_bytes),
           ("saved in HBM (+ layer inputs)", plan.saved_hbm_bytes),
           ("backward working set of one layer" + (" (compiled)" if plan.working_compiled
                                                   else ""), plan.working_bytes),
           ("loss (hidden, gradient, CE blocks)", plan.loss_bytes))
  for label, nbytes in parts:
    lines.append(f"  {label:<46} {_size(nbytes):>12}")
  verdict = "fits" if plan.fits else "DOES NOT FIT"
  lines.append(f"  {'predicted peak':<46} {_size(plan.predicted_peak_bytes):>12}  ({verdict})")
  lines.append(f"  {'offloaded to host':<46} {_size(plan.host_bytes):>12}")
  lines.append(f"  predicted step {plan.predicted_step_seconds * 1e3:.4g} ms = compute "
               f"{plan.compute_seconds * 1e3:.4g} + recompute {plan.recompute_seconds * 1e3:.4g}"
               f" + exposed host copies {plan.exposed_transfer_seconds * 1e3:.4g}")
  lines.append(f"  policy: --memory.remat={plan.policy}"
               + (f" --memory.hbm_names={','.join(plan.hbm_names)}"
                  f" --memory.host_names={','.join(plan.host_names)}"
                  if plan.policy == "tiered" else ""))
  return "\n".join(lines)


def _size(nbytes: float) -> str:
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
    if abs(nbytes) >= scale:
      return f"{nbytes / scale:.2f} {unit}"
  return f"{int(nbytes)} B"

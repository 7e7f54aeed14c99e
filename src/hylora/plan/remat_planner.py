"""The memory planner: which save points stay in HBM, which go to host, which are recomputed.

An analytic model per device: every save point of `hylora.core.save_points` gets its bytes (summed
over the layers, one micro-batch) and the time to recompute it (its forward FLOPs at the
matmul rate plus its bytes at the HBM rate). The peak is the resident state (frozen
weights, adapters, gradients, Adam moments) + one layer period's gathered weights + the
saved residuals kept in HBM (with every layer's input: the policy wraps each layer) + the
working set of one layer's backward (with the all-to-all round buffers of per-device
routed experts) + the loss. Host
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
from typing import Mapping

from hylora.model import remat_policy
from hylora.core import save_points
from hylora.core.config import Config, MemoryConfig
from hylora.core.errors import ConfigError
from hylora.plan.save_point_sizes import (dispatch_buffer_bytes, layer_work, resident_bytes,
                                          tokens_per_device)

GB = 1e9
TIERS = ("hbm", "host", "recompute")


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One accelerator as the plan sees it (defaults: H200, `../shared/docs/anchors.md`)."""

  matmul_flops: float = 600e12  # bf16 FLOP/s reached by large matmuls
  hbm_bandwidth: float = 2.8e12  # bytes/s of an elementwise pass (read + write)
  host_bandwidth: float = 52e9  # bytes/s device <-> pinned host, each way
  # Share of the host copies' time hidden behind compute (measured: docs/memory.md).
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
      return remat_policy.check(MemoryConfig(remat=self.policy))
    return remat_policy.check(
        MemoryConfig(remat="tiered", hbm_names=self.hbm_names, host_names=self.host_names))

  def table(self) -> str:
    return format_table(self)


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
  measured_working: int | None = None  # compiled layer parts (hylora.plan.part_memory)
  dispatch: int = 0  # a MoE layer's all-to-all round buffers (per-device routed experts)

  def recompute_seconds(self, name: str) -> float:
    nbytes, flops = self.points[name]
    return self.micro * (flops / self.hw.matmul_flops + 2 * nbytes / self.hw.hbm_bandwidth)

  def evaluate(self, tiers: Mapping[str, str], policy: str = "tiered") -> MemoryPlan:
    hbm = tuple(n for n in self.points if tiers[n] == "hbm")
    host = tuple(n for n in self.points if tiers[n] == "host")
    rec = tuple(n for n in self.points if tiers[n] == "recompute")
    d = self.cfg.model.d_model
    # each layer is checkpointed on its own (hylora.model.stack): its input is kept
    carries = 0 if save_points.LAYER_INPUT in hbm else self.layers * self.n * d * 2
    saved = sum(self.points[n][0] for n in hbm) + carries
    host_bytes = sum(self.points[n][0] for n in host)
    layer = self.layer_bytes if self.measured_working is None else self.measured_working
    # + the all-to-all rounds' buffers (a part compiled alone has none), + fp32
    # cotangents of the stream
    working = layer + self.dispatch + 3 * self.n * d * 4
    peak = self.resident + self.gathered + saved + working + self.loss_bytes
    recompute = sum(self.recompute_seconds(n) for n in rec)
    copy = self.micro * host_bytes / self.hw.host_bandwidth  # one way
    hidden = self.hw.host_overlap * copy
    step = (max(self.forward_seconds, hidden) + max(self.backward_seconds + recompute, hidden) + 2 *
            (copy - hidden))
    exposed = step - self.forward_seconds - self.backward_seconds - recompute
    rows = tuple(
        SavePoint(n, self.points[n][0], self.points[n][1] *
                  1.0, self.recompute_seconds(n), tiers[n]) for n in self.points)
    return MemoryPlan(
        policy=policy, hbm_names=hbm, host_names=host, recompute_names=rec, save_points=rows,
        tokens_per_device=self.n, micro_batches=self.micro, layers=self.layers,
        device_memory_bytes=int(self.device_memory), host_memory_bytes=int(self.host_memory),
        resident_bytes=self.resident, gathered_weight_bytes=self.gathered, saved_hbm_bytes=saved,
        working_bytes=working, loss_bytes=self.loss_bytes, host_bytes=host_bytes,
        predicted_peak_bytes=int(peak),
        compute_seconds=self.forward_seconds + self.backward_seconds, recompute_seconds=recompute,
        exposed_transfer_seconds=exposed if exposed > 1e-9 else 0.0, predicted_step_seconds=step,
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
  points: dict[str, list[float]] = {name: [0, 0.0] for name in save_points.ALL}
  forward = backward = 0.0
  work = {kind: layer_work(cfg, *kind, n) for kind in set(kinds)}
  layer_bytes = max(sum(w.nbytes for w in parts.values()) for parts in work.values())
  for kind in kinds:
    for name, w in work[kind].items():
      points[name][0] += w.nbytes
      points[name][1] += w.forward
      forward += w.forward
      backward += w.backward
  head = 2.0 * n * m.d_model * m.vocab_size  # the LM head: forward, recomputed, input grad
  micro = cfg.train.grad_accum
  resident, gathered = resident_bytes(cfg, mesh_shape)
  dispatch = dispatch_buffer_bytes(cfg, mesh_shape)
  loss_bytes = (n * m.d_model * 10 +
                (2 * DEFAULT_TOKEN_CHUNK + 4 * DEFAULT_LOGITS_CHUNK) * m.vocab_size)
  kept = {name: (int(v[0]), v[1]) for name, v in points.items() if v[0] > 0}
  return _Model(cfg=cfg, hw=hw, n=n, micro=micro, layers=m.layers, points=kept,
                layer_bytes=layer_bytes, forward_seconds=micro * (forward + head) / hw.matmul_flops,
                backward_seconds=micro * (backward + 2 * head) / hw.matmul_flops, resident=resident,
                gathered=gathered, loss_bytes=loss_bytes, device_memory=int(device_memory_bytes),
                host_memory=int(hw.host_memory_bytes), measured_working=working_bytes,
                dispatch=dispatch)


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


def plan_memory(cfg: Config, mesh_shape, device_memory_bytes: float, *, hardware: Hardware = H200,
                working_bytes: int | None = None) -> MemoryPlan:
  """The tiered policy with the lowest predicted step time that fits the budget.

  `working_bytes`: one layer's backward working set as compiled on the target backend
  (`hylora.plan.part_memory.measured_working_bytes`); without it, the analytic estimate (the
  largest layer's save points), which is low by 2-3x for the attention and MoE parts."""
  return _search(_build(cfg, mesh_shape, device_memory_bytes, hardware, working_bytes))


def replan_after_compile(cfg: Config, mesh_shape, device_memory_bytes: float, plan: MemoryPlan,
                         compiled_peak_bytes: float, *, hardware: Hardware = H200,
                         working_bytes: int | None = None, slack: float = 0.01) -> MemoryPlan:
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
  policy = remat_policy.check(policy or cfg.memory)
  model = _build(cfg, mesh_shape, device_memory_bytes, hardware, working_bytes)
  hbm, host = remat_policy.tiers(policy, backend="gpu")
  tiers = {n: "hbm" if n in hbm else "host" if n in host else "recompute" for n in model.points}
  return model.evaluate(tiers, policy.remat)


# ---- the table ---------------------------------------------------------------------------


def format_table(plan: MemoryPlan) -> str:
  lines = [
      f"memory plan ({plan.policy}): {plan.layers} layers, {plan.tokens_per_device} tokens "
      f"per device x {plan.micro_batches} micro-batch(es); budget "
      f"{_size(plan.device_memory_bytes)} device, {_size(plan.host_memory_bytes)} host",
      f"  {'save point':<16} {'all layers':>12} {'recompute ms':>13}  tier"
  ]
  for p in plan.save_points:
    lines.append(f"  {p.name:<16} {_size(p.bytes):>12} {p.recompute_seconds * 1e3:>13.3g}  "
                 f"{p.tier}")
  parts = (("resident (weights, adapters, optimizer)",
            plan.resident_bytes), ("gathered weights of one period", plan.gathered_weight_bytes),
           ("saved in HBM (+ layer inputs)", plan.saved_hbm_bytes),
           ("backward working set of one layer" + (" (compiled)" if plan.working_compiled else ""),
            plan.working_bytes), ("loss (hidden, gradient, CE blocks)", plan.loss_bytes))
  for label, nbytes in parts:
    lines.append(f"  {label:<46} {_size(nbytes):>12}")
  verdict = "fits" if plan.fits else "DOES NOT FIT"
  lines.append(f"  {'predicted peak':<46} {_size(plan.predicted_peak_bytes):>12}  ({verdict})")
  lines.append(f"  {'offloaded to host':<46} {_size(plan.host_bytes):>12}")
  lines.append(f"  predicted step {plan.predicted_step_seconds * 1e3:.4g} ms = compute "
               f"{plan.compute_seconds * 1e3:.4g} + recompute {plan.recompute_seconds * 1e3:.4g}"
               f" + exposed host copies {plan.exposed_transfer_seconds * 1e3:.4g}")
  lines.append(f"  policy: --memory.remat={plan.policy}" + (
      f" --memory.hbm_names={','.join(plan.hbm_names)}"
      f" --memory.host_names={','.join(plan.host_names)}" if plan.policy == "tiered" else ""))
  return "\n".join(lines)


def _size(nbytes: float) -> str:
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
    if abs(nbytes) >= scale:
      return f"{nbytes / scale:.2f} {unit}"
  return f"{int(nbytes)} B"

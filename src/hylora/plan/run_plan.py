"""The run's plan: every choice the train step is compiled with, resolved once from the
configuration and the devices.

A plan names the mesh, how routed tokens reach their experts (dispatcher, transport,
what its buffers hold and whether it can drop), the remat policy and its save points
(the memory planner's, for `memory.remat=auto`), and each op's implementation and
whether it runs per device. The main command prints it at start and writes it beside
`config.json` (`plan.json`); the dry run compiles the same plan (docs/dry_run.md).

A plan is made for a *target* platform: a run's is its devices'; a dry run's is the GPU
cluster its simulated devices stand for (or the CPU, for a preset that runs on
simulated CPU devices). Where the target's implementation of an op does not exist on
the platform the step is compiled on, the catalog's choice there stands in for it; the
CPU's choices are the GPU kernels' memory equivalents (hylora.ops.catalog), and
`stand_ins` names each one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from hylora.core.config import Config, MemoryConfig
from hylora.core.errors import ConfigError
from hylora.plan.base_storage import BaseStorage, base_storage
from hylora.plan.context_plan import ContextPlan, context_plan

GB = 1e9
PLAN_FILE = "plan.json"
EP_DISPATCHER = "ep_alltoall"
EXPERT_OPS = ("grouped_matmul", "grouped_lora", "quantized_grouped_matmul")


@dataclasses.dataclass(frozen=True)
class OpPlan:
  op: str
  implementation: str  # on the target platform
  per_device: str  # how a kernel XLA cannot partition runs per device ("" when XLA splits it)
  compiled_as: str = ""  # the stand-in compiled on this platform, when it differs


@dataclasses.dataclass(frozen=True)
class ExpertPlan:
  dispatcher: str  # "ep_alltoall" (per device, all-to-all) or "dropless" (one program)
  transport: str  # ep_alltoall: "padded" or "ragged" all-to-all
  drops: bool  # only with an explicit model.moe.capacity_factor > 0
  capacity_factor: float
  round_capacity: float
  rows_per_round: int  # rows one device sends one expert rank per round and chunk
  # One MoE layer's round buffers per device, every chunk's (expert_parallel.round_buffer_bytes)
  buffer_bytes: int
  overlap_chunks: int


@dataclasses.dataclass(frozen=True)
class RematPlan:
  policy: str  # the MemoryConfig.remat the step runs
  hbm_names: tuple[str, ...]
  host_names: tuple[str, ...]
  planned: bool  # chosen by the memory planner (memory.remat=auto)
  device_memory: float  # the device's budget (memory.device_memory, or the device's limit)
  planned_for: float  # what the planner filled: the budget less memory.plan_headroom
  predicted_peak: int  # the planner's GPU-side estimate for this policy
  fits: bool


@dataclasses.dataclass(frozen=True)
class RunPlan:
  preset: str
  devices: int
  processes: int
  mesh: dict
  target: str  # the platform the plan is for
  compiled_on: str  # the platform the step is compiled on
  experts: ExpertPlan | None  # None: no routed experts
  memory: RematPlan
  ops: tuple[OpPlan, ...]
  base: BaseStorage | None = None  # the frozen base as the checkpoint packs it (None: bf16)
  sequence: ContextPlan | None = None  # how sequences split over devices (None: whole)

  def apply(self, cfg: Config) -> Config:
    """`cfg` with the plan's resolved choices (dispatcher, remat policy, the stand-ins of
    catalog.STAND_INS compiled here) in place of "auto"; every other field as given."""
    from hylora.ops.catalog import KERNEL_CHOICE_FIELDS, STAND_INS

    moe = cfg.model.moe
    if self.experts is not None:
      moe = dataclasses.replace(moe, dispatch=self.experts.dispatcher)
    memory = dataclasses.replace(cfg.memory, remat=self.memory.policy,
                                 hbm_names=self.memory.hbm_names, host_names=self.memory.host_names)
    stand_ins = {
        KERNEL_CHOICE_FIELDS[o.op]: o.compiled_as
        for o in self.ops
        if (o.op, o.implementation) in STAND_INS and o.compiled_as and
        getattr(cfg.kernels, KERNEL_CHOICE_FIELDS[o.op]) == "auto"
    }
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe), memory=memory,
                               kernels=dataclasses.replace(cfg.kernels, **stand_ins))

  def stand_ins(self) -> list[str]:
    """One line per op compiled here with another implementation than the target's."""
    return [
        f"{o.op}: {o.compiled_as} stands in for {o.implementation} on {self.compiled_on}"
        for o in self.ops
        if o.compiled_as
    ]

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def write(self, directory: str | Path) -> Path:
    path = Path(directory) / PLAN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
    return path

  def text(self) -> str:
    """The plan as a person reads it (what the run and its dry run both print)."""
    mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
    lines = [
        f"plan: {self.preset} on {self.devices} {self.target} devices "
        f"({self.processes} process{'es' if self.processes > 1 else ''}), mesh {mesh}"
    ]
    e = self.experts
    if e is not None:
      if e.dispatcher == EP_DISPATCHER:
        rounds = (f"drops rows over {e.rows_per_round} per rank (capacity_factor "
                  f"{e.capacity_factor:g})"
                  if e.drops else f"dropless, in rounds of {e.rows_per_round} rows per rank "
                  f"({e.round_capacity:g} x the mean; more rows, more rounds)")
        lines.append(f"  routed experts: ep_alltoall per device, {e.transport} all-to-all, "
                     f"{e.overlap_chunks} chunk(s), {rounds}; round buffers "
                     f"{_size(e.buffer_bytes)} per device and layer")
      elif self.devices > 1:
        lines.append(f"  routed experts: dropless as one program over {self.devices} devices: "
                     "XLA partitions the grouped matmuls (a kernel it cannot split gathers "
                     "every row on every device); ep_alltoall runs them per device")
      else:
        lines.append("  routed experts: dropless, one program (sorted rows, grouped matmuls)")
    if self.sequence is not None:
      lines.append(self.sequence.text())
    m = self.memory
    how = (f"the planner's for {_size(m.planned_for)} of {_size(m.device_memory)} per device"
           if m.planned else "as given")
    lines.append(f"  remat: {m.policy} ({how}; predicted peak {_size(m.predicted_peak)}"
                 f"{'' if m.fits else ', DOES NOT FIT'})")
    if m.policy == "tiered":
      lines.append(f"    in HBM: {', '.join(m.hbm_names) or '-'}; to host: "
                   f"{', '.join(m.host_names) or '-'}; the rest recomputed")
    b = self.base
    if b is not None:
      lines.append(f"  frozen base: {b.format} as shipped ({b.packed_arrays} packed kernels: "
                   f"{', '.join(b.packed_kinds)}); {_size(b.nbytes)} in all, a bf16 base "
                   f"{_size(b.bf16_nbytes)}")
    ops = ", ".join(f"{o.op}={o.implementation}" +
                    (f" (per device: {o.per_device})" if o.per_device else "") for o in self.ops)
    lines.append(f"  ops: {ops}")
    return "\n".join(lines)


def check_choices(cfg: Config) -> None:
  """The names a registry looks up when the step is built (the dispatcher, every kernel
  choice), checked before anything is: a ConfigError naming field, value and choices."""
  from dataclasses import fields

  from hylora.core.config import KernelConfig
  from hylora.model.ffn.dispatchers import DISPATCHERS
  from hylora.ops.catalog import KERNEL_CHOICE_FIELDS, catalog

  dispatch = cfg.model.moe.dispatch
  if dispatch not in DISPATCHERS:
    raise ConfigError(f"model.moe.dispatch: unknown dispatcher {dispatch!r}; choose one of "
                      f"{sorted(DISPATCHERS)}")
  for f in fields(KernelConfig):
    ops = [op for op, name in KERNEL_CHOICE_FIELDS.items() if name == f.name]
    choices = sorted(set.intersection(*(set(catalog().choices(op)) for op in ops)))
    value = getattr(cfg.kernels, f.name)
    if value not in choices:
      raise ConfigError(f"kernels.{f.name}: unknown implementation {value!r}; choose one of "
                        f"{choices}")


def device_budget(cfg: Config, mesh) -> float:
  """memory.device_memory, or less where a device reports a smaller limit (the least
  over all processes: every process must resolve the same plan)."""
  local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in local[:1]]
  budget = min([cfg.memory.device_memory, *(x for x in limits if x)])
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    budget = float(np.min(multihost_utils.process_allgather(np.float64(budget))))
  return budget


def expert_plan(cfg: Config, mesh_shape: dict, devices: int) -> ExpertPlan | None:
  from hylora.model.ffn.dispatchers import resolved_dispatcher
  from hylora.model.ffn.expert_parallel import round_rows
  from hylora.plan.save_point_sizes import dispatch_buffer_bytes, tokens_per_device

  m = cfg.model
  if all(ffn not in ("moe", "latent_moe") for _, ffn in m.layer_kinds()):
    return None
  moe = m.moe
  shape = (mesh_shape.get("fsdp", 1), mesh_shape.get("expert", 1))
  tokens = tokens_per_device(cfg, shape)  # one MoE call on one device
  rows = round_rows(max(1, tokens // moe.overlap_chunks) * moe.top_k, shape[1], moe)
  buffers = dispatch_buffer_bytes(cfg, shape)
  return ExpertPlan(dispatcher=resolved_dispatcher(moe.dispatch, devices), transport=moe.transport,
                    drops=moe.capacity_factor > 0, capacity_factor=moe.capacity_factor,
                    round_capacity=moe.round_capacity, rows_per_round=rows, buffer_bytes=buffers,
                    overlap_chunks=moe.overlap_chunks)


def remat_plan(cfg: Config, mesh_shape: dict, budget: float) -> RematPlan:
  from hylora.plan.remat_planner import estimate_policy, plan_memory

  shape = (mesh_shape.get("fsdp", 1), mesh_shape.get("expert", 1))
  planning = budget * (1 - cfg.memory.plan_headroom)
  if cfg.memory.remat == "auto":
    plan = plan_memory(cfg, shape, planning)
    return RematPlan(plan.policy, tuple(plan.hbm_names), tuple(plan.host_names), True, budget,
                     planning, plan.predicted_peak_bytes, plan.fits)
  estimate = estimate_policy(cfg, shape, budget)
  return RematPlan(cfg.memory.remat, tuple(cfg.memory.hbm_names), tuple(cfg.memory.host_names),
                   False, budget, budget, estimate.predicted_peak_bytes, estimate.fits)


def quantized_ops(cfg: Config) -> tuple[str, ...]:
  """The ops of the products with packed kernels (hylora.quant), where the base has any."""
  if cfg.model.quantization.format == "none":
    return ()
  kinds = set(base_storage(cfg).packed_kinds)
  return (("quantized_grouped_matmul",) if "experts" in kinds else
          ()) + (("quantized_matmul",) if kinds - {"experts"} else ())


def op_plans(cfg: Config, target: str, compiled_on: str,
             experts: ExpertPlan | None) -> tuple[OpPlan, ...]:
  """The implementation of every op the model calls (hylora.core.architecture.model_ops)."""
  from hylora.core.architecture import model_ops
  from hylora.ops.catalog import KERNEL_CHOICE_FIELDS, STAND_INS, catalog
  from hylora.ops.registry import AUTO, per_shard_mode

  out = []
  for op in model_ops(cfg) + quantized_ops(cfg):
    field = KERNEL_CHOICE_FIELDS.get(op)
    choice = getattr(cfg.kernels, field) if field else AUTO
    there = catalog().pick(op, choice, target)
    here = catalog().pick(op, choice, compiled_on)
    if compiled_on not in there.backends and (op, there.name) in STAND_INS:
      here = catalog().pick(op, STAND_INS[(op, there.name)], compiled_on)
    per_device = per_shard_mode(there.per_shard) or ""
    if op in EXPERT_OPS and experts is not None and experts.dispatcher == EP_DISPATCHER:
      per_device = "inside ep_alltoall"
    out.append(OpPlan(op, there.name, per_device, here.name if here.name != there.name else ""))
  return tuple(out)


def resolve(cfg: Config, mesh, *, target: str | None = None) -> RunPlan:
  """The plan of `cfg` on `mesh`; `target`: the platform the plan is for (default: the
  mesh's devices')."""
  check_choices(cfg)
  compiled_on = mesh.devices.flat[0].platform
  target = target or compiled_on
  shape = {name: int(size) for name, size in mesh.shape.items()}
  try:
    memory = remat_plan(cfg, shape, device_budget(cfg, mesh))
  except ConfigError:
    raise
  except Exception as e:  # the planner's model does not cover something: say what
    raise ConfigError(f"memory.remat: the memory planner failed ({type(e).__name__}: {e}); "
                      "choose a policy (full, minimal, tiered, none)") from e
  experts = expert_plan(cfg, shape, int(mesh.size))
  return RunPlan(preset=cfg.preset, devices=int(mesh.size), processes=jax.process_count(),
                 mesh=shape, target=target, compiled_on=compiled_on, experts=experts, memory=memory,
                 ops=op_plans(cfg, target, compiled_on, experts),
                 base=base_storage(cfg) if cfg.model.quantization.format != "none" else None,
                 sequence=context_plan(cfg, shape))


def _size(nbytes: float) -> str:
  for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
    if abs(nbytes) >= scale:
      return f"{nbytes / scale:.2f} {unit}"
  return f"{int(nbytes)} B"

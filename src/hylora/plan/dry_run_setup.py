"""What a dry run compiles: the run's configuration with the choices that make a CPU
compile stand for a GPU step.

A dry run compiles on XLA:CPU for simulated devices, but its memory figures must be a
GPU step's. So, unless the command line names them:

- devices: as many simulated devices as the mesh asks for;
- routed experts go through the expert-parallel dispatcher (`ep_alltoall`) when the mesh
  has an expert axis;
- its capacity factor is 1.25 when the configuration's is 0 (dropless): dropless padded
  buffers are sized for the worst case (every pair of a device to one rank: 64 x the
  real rows on 64 ranks), which is not what a step allocates;
- kernels: implementations whose CPU lowering allocates what the GPU kernels allocate
  (`DRY_RUN_KERNELS`); every one is exact and registered in `hylora.ops.catalog`;
- XLA:CPU flags (`DRY_RUN_XLA_FLAGS`): its memory-optimised scheduler, and no LLVM
  optimisation of a program that never runs.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from hylora.core.config import Config, KernelConfig
from hylora.core.errors import ConfigError

EP_DISPATCHER = "ep_alltoall"
DRY_RUN_CAPACITY_FACTOR = 1.25

# KernelConfig field -> (implementation, why its CPU lowering stands for the GPU's).
DRY_RUN_KERNELS = {
    "grouped_matmul": ("loop", "grouped matmuls loop over the local experts (XLA:CPU "
                       "expands ragged_dot into one [rows, N] fp32 product per "
                       "expert; the Mosaic kernel writes one [rows, N]) and sum "
                       "weight gradients over row blocks (XLA:CPU converts a "
                       "row-contracting bf16 product to fp32 whole)"),
}

# XLA:CPU's default scheduler orders the program for the CPU's threads: it runs the
# recomputations of every layer of a scanned period side by side, holding four MoE
# layers' buffers at once (docs/dry_run.md). The
# memory-optimised scheduler keeps each layer's recomputation next to its backward;
# XLA:GPU's scheduler also works against a memory limit (the device's). Buffer
# assignment (every memory figure) comes before LLVM, whose optimisation of a program
# that is never executed is skipped (a third of the compile time).
DRY_RUN_XLA_FLAGS = ("--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
                     "--xla_backend_optimization_level=0",
                     "--xla_llvm_disable_expensive_passes=true")


def set_xla_flags() -> None:
  """Adds DRY_RUN_XLA_FLAGS to XLA_FLAGS (a flag already set is kept); only before JAX
  starts its backend."""
  flags = os.environ.get("XLA_FLAGS", "")
  extra = [f for f in DRY_RUN_XLA_FLAGS if f.split("=")[0] not in flags]
  os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()


def dry_run_config(cfg: Config, explicit=()) -> Config:
  """The configuration a dry run compiles (see the module doc); fields named in
  `explicit` (the command line's overrides) are left as given."""
  from hylora.model.ffn.dispatchers import DISPATCHERS

  if cfg.mesh.devices <= 0:
    if cfg.mesh.fsdp < 1:
      raise ConfigError("mesh.fsdp: a dry run needs a fixed mesh (mesh.fsdp >= 1) or "
                        "--devices N")
    cfg = dataclasses.replace(
        cfg, mesh=dataclasses.replace(cfg.mesh, devices=cfg.mesh.fsdp * cfg.mesh.expert))
  moe_cfg = cfg.model.moe
  if ("model.moe.dispatch" not in explicit and EP_DISPATCHER in DISPATCHERS and
      cfg.mesh.expert > 1):
    moe_cfg = dataclasses.replace(moe_cfg, dispatch=EP_DISPATCHER)
  if (moe_cfg.dispatch == EP_DISPATCHER and moe_cfg.capacity_factor <= 0 and
      "model.moe.capacity_factor" not in explicit):
    moe_cfg = dataclasses.replace(moe_cfg, capacity_factor=DRY_RUN_CAPACITY_FACTOR)
  kernels = dataclasses.replace(
      cfg.kernels, **{
          field: choice
          for field, (choice, _) in DRY_RUN_KERNELS.items()
          if f"kernels.{field}" not in explicit
      })
  cfg = dataclasses.replace(cfg, kernels=kernels, model=dataclasses.replace(cfg.model, moe=moe_cfg))
  return cfg.validate()


def implementations(kernels: KernelConfig, backend: str | None = None) -> dict[str, str]:
  """{op: the implementation the step runs} for every registered op."""
  from hylora.ops.catalog import KERNEL_CHOICE_FIELDS, catalog

  backend = backend or jax.default_backend()
  return {
      op: catalog().pick(op, getattr(kernels, field), backend).name
      for op, field in sorted(KERNEL_CHOICE_FIELDS.items())
  }


def stand_ins(cfg: Config) -> list[str]:
  """One line per dry-run choice in effect that a real run would not make."""
  lines = []
  moe_cfg = cfg.model.moe
  if moe_cfg.dispatch == EP_DISPATCHER and moe_cfg.capacity_factor > 0:
    lines.append(f"model.moe.capacity_factor={moe_cfg.capacity_factor:g}: all-to-all buffers "
                 f"of {moe_cfg.capacity_factor:g} x the mean rows per rank (a factor of 0, "
                 "dropless, sizes them for the worst case)")
  for field, (choice, why) in DRY_RUN_KERNELS.items():
    if getattr(cfg.kernels, field) == choice:
      lines.append(f"kernels.{field}={choice}: {why}")
  return lines

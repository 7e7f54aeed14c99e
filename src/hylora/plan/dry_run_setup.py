"""What a dry run compiles: the run's own plan (hylora.plan.run_plan), on as many
simulated CPU devices as its mesh asks for.

Nothing of the plan is swapped: the dispatcher, its buffers, the remat policy and the
kernels are the run's. Where the target's implementation of an op does not exist on
XLA:CPU, the CPU's choice stands in for it, and the CPU's choices are the GPU kernels'
memory equivalents (hylora.ops.catalog: the grouped matmuls loop over the local experts,
allocating one [rows, N] product as the Mosaic kernel does); the report names each
stand-in. XLA:CPU flags (`DRY_RUN_XLA_FLAGS`) order the program for memory and skip
optimising code that never runs.
"""

from __future__ import annotations

import dataclasses

from hylora.core.config import Config
from hylora.core.errors import ConfigError
from meshes.mesh import add_xla_flags

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
  add_xla_flags(*DRY_RUN_XLA_FLAGS)


def dry_run_target(cfg: Config) -> str:
  """The platform a dry run's plan is for: a preset on simulated CPU devices runs on the
  CPU; any other stands for GPUs."""
  return "cpu" if cfg.mesh.devices > 0 else "gpu"


def dry_run_config(cfg: Config) -> Config:
  """`cfg` on as many simulated devices as its mesh asks for."""
  if cfg.mesh.devices <= 0:
    if cfg.mesh.fsdp < 1:
      raise ConfigError("mesh.fsdp: a dry run needs a fixed mesh (mesh.fsdp >= 1) or "
                        "--devices N")
    cfg = dataclasses.replace(
        cfg, mesh=dataclasses.replace(cfg.mesh, devices=cfg.mesh.fsdp * cfg.mesh.expert))
  return cfg.validate()

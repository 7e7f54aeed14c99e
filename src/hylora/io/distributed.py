"""Multi-host runs: `jax.distributed` from explicit flags or the SLURM environment, and
the rows of each global batch that this process feeds.

Failure detection: every process heartbeats to the coordination service (process 0).
When a process dies, the service stops hearing from it within `heartbeat_timeout_s` and
tells the others, which then exit non-zero with an error naming the lost task; a
collective that loses its peer fails at once. No process waits forever on a dead one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time

import jax

from hylora.core.errors import ConfigError
from meshes.mesh import add_xla_flags

DEFAULT_PORT_BASE = 61440  # SLURM runs without --coordinator: port = base + job id % 4096
DEFAULT_TIMEOUT_S = 300  # how long processes wait for each other to start (JAX's default)
# XLA:CPU orders a device's collectives by when they start, not end: a loop holding a
# collective and an op Eigen runs on its thread pool returns while its iterations go on,
# the next collective starts beside them on some devices and not on others, and the
# processes wait on each other forever (a device in the loop's all-reduce, its peer in
# the next all-gather). Single-threaded Eigen runs every op inline, in program order.
# XLA:CPU's concurrency-optimized scheduler orders independent collectives differently
# on different devices: with the expert axis across processes, the all-to-alls of the
# expert dispatch and the other collectives met in different orders and the run hung
# before its first step; the default scheduler keeps one order on every device.
CPU_COLLECTIVE_XLA_FLAGS = ("--xla_cpu_multi_thread_eigen=false",
                            "--xla_cpu_enable_concurrency_optimized_scheduler=false")


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
  coordinator: str  # host:port of process 0
  num_processes: int
  process_id: int
  source: str  # "flags" or "slurm"


def first_host(nodelist: str) -> str:
  """The first host of a SLURM node list: 'gpu[003-007,9],cpu1' -> 'gpu003'."""
  head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
  if "[" not in head:
    return head.strip()
  prefix, rest = head.split("[", 1)
  first = rest.split("]", 1)[0].split(",")[0].split("-")[0]
  return prefix + first


def resolve(coordinator: str | None = None, num_processes: int | None = None,
            process_id: int | None = None, env=None) -> ProcessGroup | None:
  """The process group from explicit flags, else from SLURM (more than one task), else
  None (a single-process run)."""
  env = os.environ if env is None else env
  given = {
      "--coordinator": coordinator,
      "--num-processes": num_processes,
      "--process-id": process_id
  }
  if any(v is not None for v in given.values()):
    missing = [k for k, v in given.items() if v is None]
    if missing:
      raise ConfigError(f"{', '.join(missing)}: --coordinator, --num-processes and "
                        "--process-id go together")
    group = ProcessGroup(coordinator, num_processes, process_id, "flags")
  elif int(env.get("SLURM_NTASKS", "1")) > 1:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist or "SLURM_PROCID" not in env:
      raise ConfigError("SLURM: SLURM_NTASKS > 1 but SLURM_PROCID / SLURM_STEP_NODELIST are "
                        "not set; pass --coordinator, --num-processes and --process-id")
    port = env.get("JAX_COORDINATOR_PORT") or str(DEFAULT_PORT_BASE +
                                                  int(env.get("SLURM_JOB_ID", "0")) % 4096)
    group = ProcessGroup(f"{first_host(nodelist)}:{port}", int(env["SLURM_NTASKS"]),
                         int(env["SLURM_PROCID"]), "slurm")
  else:
    return None
  if ":" not in group.coordinator:
    raise ConfigError(f"--coordinator: expected host:port, got {group.coordinator!r}")
  if group.num_processes < 1:
    raise ConfigError(f"--num-processes: must be >= 1, got {group.num_processes}")
  if not 0 <= group.process_id < group.num_processes:
    raise ConfigError(f"--process-id: must be in [0, {group.num_processes}), got "
                      f"{group.process_id}")
  return group


class CoordinatorUnreachable(RuntimeError):
  """No coordination service answered at the coordinator's address in time."""


def wait_for_coordinator(address: str, timeout_s: float, *, poll_s: float = 1.0) -> float:
  """Waits until something accepts connections at `address` (host:port); returns the
  seconds left of `timeout_s`. JAX itself aborts the process (no exception) when the
  service cannot be reached, so processes other than the coordinator check first."""
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout_s
  last = None
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=min(poll_s, timeout_s)):
        return max(deadline - time.monotonic(), 1.0)
    except OSError as e:
      last = e
    if time.monotonic() + poll_s > deadline:
      raise CoordinatorUnreachable(
          f"--coordinator {address}: no coordination service answered within {timeout_s:g} s "
          f"({last.strerror or last}); is process 0 running there, and is the port open? "
          "(--distributed-timeout sets the wait)")
    time.sleep(poll_s)


def initialize(group: ProcessGroup, *, timeout_s: float = DEFAULT_TIMEOUT_S,
               heartbeat_timeout_s: int = 30, cpu_collectives: bool = False) -> None:
  """Joins the process group within `timeout_s` (every process must have started by
  then); must run before JAX creates its backends."""
  if cpu_collectives:  # simulated CPU devices talk over gloo (TCP) between processes
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    add_xla_flags(*CPU_COLLECTIVE_XLA_FLAGS)
  left = timeout_s
  if group.process_id != 0:
    left = wait_for_coordinator(group.coordinator, timeout_s)
  jax.distributed.initialize(group.coordinator, group.num_processes, group.process_id,
                             initialization_timeout=int(math.ceil(left)),
                             heartbeat_timeout_seconds=heartbeat_timeout_s,
                             shutdown_timeout_seconds=heartbeat_timeout_s)


def local_rows(sharding, global_shape: tuple[int, ...]) -> slice:
  """The rows of a global batch [rows, ...] placed by `sharding` that this process's
  devices hold: what it passes to `jax.make_array_from_process_local_data`."""
  spans = {
      index[0].indices(global_shape[0])[:2]
      for index in sharding.addressable_devices_indices_map(global_shape).values()
  }
  covered = sorted(spans)
  end = covered[0][0]
  for a, b in covered:  # replicas overlap; a gap would need rows from elsewhere
    if a > end:
      raise ConfigError(f"mesh: this process's devices hold rows {covered} of the batch, "
                        "which are not contiguous")
    end = max(end, b)
  return slice(covered[0][0], end)

"""What the device did during traced runs: busy time, idle gaps and each HLO instruction's
kernel time, from the JAX profiler's perfetto trace.

XLA's per-instruction summary (hylora.profile.pgle's profile, what its scheduler reads)
undercounts instructions that launch several kernels (docs/performance.md has a step
where it missed a third of the device's busy time). The trace's own
kernel and copy events, merged into busy intervals, give the wall-clock account: what the
device ran, for how long, and where it waited.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import tempfile

import jax


@dataclasses.dataclass
class Timeline:
  """One device's activity over `runs` traced runs, per run. The runs follow each other,
  so the host's turnaround between two runs counts as idle time."""
  span_ms: float  # the first event's start to the last one's end
  busy_ms: float  # time covered by at least one kernel or copy
  events: int
  by_instruction_us: dict[str, float]  # HLO instruction -> summed event time
  gaps: list[tuple[float, str, str]]  # (idle ms, the event before, the event after), longest first

  @property
  def idle_ms(self) -> float:
    return self.span_ms - self.busy_ms


def record(run_once, runs: int = 3) -> list[dict]:
  """Trace events of `runs` calls of `run_once()` (after one untraced warm-up call)."""
  jax.block_until_ready(run_once())
  with tempfile.TemporaryDirectory() as logdir:
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
      for _ in range(runs):
        jax.block_until_ready(run_once())
    files = glob.glob(os.path.join(logdir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
      return []
    with gzip.open(files[0], "rt") as f:
      trace = json.load(f)
  return trace["traceEvents"] if isinstance(trace, dict) else trace


def _names(events, kind):
  return {
      (e["pid"], e.get("tid")) if kind == "thread_name" else e["pid"]: e["args"]["name"]
      for e in events
      if e.get("ph") == "M" and e.get("name") == kind
  }


def device_events(events) -> list[dict]:
  """The complete events of the first device's streams (kernels, copies), in start order."""
  processes = _names(events, "process_name")
  devices = sorted(pid for pid, name in processes.items() if name.startswith("/device:"))
  if not devices:
    return []
  threads = _names(events, "thread_name")
  out = [
      e for e in events if e.get("ph") == "X" and e["pid"] == devices[0] and
      "Stream" in threads.get((e["pid"], e.get("tid")), "Stream")
  ]
  return sorted(out, key=lambda e: e["ts"])


def instruction(event) -> str:
  """The HLO instruction behind an event (the event's own name where it carries none)."""
  return event.get("args", {}).get("hlo_op") or event["name"]


def timeline(events, runs: int = 1, gaps: int = 10) -> Timeline | None:
  """The first device's Timeline per run, or None where the trace has no device events
  (the CPU backend records none)."""
  kernels = device_events(events)
  if not kernels:
    return None
  busy = 0.0
  end = kernels[0]["ts"]
  last = kernels[0]
  idle = []
  by_instruction: dict[str, float] = {}
  for e in kernels:
    start, stop = e["ts"], e["ts"] + e.get("dur", 0.0)
    name = instruction(e)
    by_instruction[name] = by_instruction.get(name, 0.0) + e.get("dur", 0.0) / runs
    if start > end:
      idle.append(((start - end) / 1e3, instruction(last), name))
    if stop > end:
      busy += stop - max(start, end)
      end, last = stop, e
  idle.sort(key=lambda g: -g[0])
  return Timeline(span_ms=(end - kernels[0]["ts"]) / 1e3 / runs, busy_ms=busy / 1e3 / runs,
                  events=len(kernels), gaps=idle[:gaps],
                  by_instruction_us=dict(sorted(by_instruction.items(), key=lambda kv: -kv[1])))

"""Profile-guided scheduling: compile, time every instruction on the device, compile again.

XLA:GPU's latency-hiding scheduler decides what runs under each asynchronous collective
from a cost model, and that model knows nothing of custom calls: a Pallas kernel (the
expert grouped matmul) looks free, so the scheduler never hides an all-to-all behind one.
Given a measured profile (the device time of every instruction of this very program),
it schedules from real costs. `compile_with_profile` runs the program a few times under
the JAX profiler, turns the trace into XLA's ProfiledInstructionsProto and recompiles
with it (`fdo_profile`). Only NVIDIA GPUs produce such a profile; elsewhere the first
compilation is returned unchanged.
"""

from __future__ import annotations

import glob
import os
import struct
import tempfile

import jax


def instruction_profile(run_once, runs: int = 3) -> bytes:
  """Serialized ProfiledInstructionsProto of `runs` calls of `run_once()` (which runs
  one compiled program and returns its outputs; it may thread state between calls),
  empty where the backend records no per-instruction device times."""
  from jax.experimental import profiler as exp_profiler

  jax.block_until_ready(run_once())  # the first run outside the trace: warm-up
  with tempfile.TemporaryDirectory() as logdir:
    with jax.profiler.trace(logdir):
      for _ in range(runs):
        jax.block_until_ready(run_once())
    runs_dirs = sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*")))
    if not runs_dirs:
      return b""
    return exp_profiler.get_profiled_instructions_proto(runs_dirs[-1])


def compile_with_profile(lowered, args, runs: int = 3):
  """(compiled, profiled): `lowered` compiled with the measured costs of its own
  instructions when the device yields them (profiled=True), else compiled as is."""
  compiled = lowered.compile()
  profile = instruction_profile(lambda: compiled(*args), runs)
  if not profile:
    return compiled, False
  return lowered.compile({"fdo_profile": profile}), True


def instruction_costs(profile: bytes) -> dict[str, float]:
  """{HLO instruction name: device microseconds} from a serialized
  ProfiledInstructionsProto (field 1: repeated InstructionCost {1: name, 2: cost_us}).

  A few lines of protobuf wire decoding instead of a dependency on XLA's proto classes."""
  costs: dict[str, float] = {}
  for field, value in _fields(profile):
    if field == 1:  # InstructionCost
      entry = dict(_fields(value))
      if 1 in entry:
        name = entry[1].decode()
        cost = struct.unpack("<d", entry[2])[0] if 2 in entry else 0.0
        costs[name] = costs.get(name, 0.0) + cost
  return costs


def _varint(data: bytes, i: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    byte = data[i]
    value |= (byte & 0x7F) << shift
    i, shift = i + 1, shift + 7
    if byte < 0x80:
      return value, i


def _fields(data: bytes):
  """(field number, raw value) pairs of one protobuf message: varints as ints, 64-bit
  and length-delimited fields as bytes."""
  i = 0
  while i < len(data):
    key, i = _varint(data, i)
    field, wire = key >> 3, key & 7
    if wire == 0:
      value, i = _varint(data, i)
    elif wire == 1:
      value, i = data[i:i + 8], i + 8
    elif wire == 2:
      size, i = _varint(data, i)
      value, i = data[i:i + size], i + size
    elif wire == 5:
      value, i = data[i:i + 4], i + 4
    else:
      raise ValueError(f"profile: unsupported protobuf wire type {wire} (field {field})")
    yield field, value

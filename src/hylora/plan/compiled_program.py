"""Reading a compiled XLA program: what XLA's C++ writes to stderr while compiling (the
SPMD partitioner's warnings), and the largest arrays of the optimized per-device program."""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import sys
import tempfile


@contextlib.contextmanager
def captured_stderr():
  """Captures what XLA's C++ writes to stderr (fd 2) into a temporary file."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode="w+b") as tmp:
    os.dup2(tmp.fileno(), 2)
    reader = io.StringIO()
    try:
      yield reader
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      tmp.seek(0)
      reader.write(tmp.read().decode(errors="replace"))
      reader.seek(0)


_REPLICATION = re.compile(r"Involuntary full rematerialization.*?HLO operation %\S+ = "
                          r"(\w+\[[0-9,]*\])")


def involuntary_replications(log: str) -> list[dict]:
  """Tensors the SPMD partitioner had to replicate in full ("involuntary full
  rematerialization"), by shape: the sign of a sharding the partitioner cannot follow."""
  counts: dict[str, int] = {}
  for shape in _REPLICATION.findall(log):
    counts[shape] = counts.get(shape, 0) + 1
  return [{"shape": k, "count": v} for k, v in sorted(counts.items(), key=lambda kv: -kv[1])]


_VALUE = re.compile(r"%\S+ = (\w+)\[([0-9,]+)\][^ ]* (\S+?)\(.*?(?:op_name=\"([^\"]*)\")?")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{\s*$")
_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8
}


def largest_values(hlo_text: str, count: int = 6) -> list[dict]:
  """The largest array shapes the optimized per-device program computes (shape, bytes,
  op and the JAX op that made it): where the temporaries go."""
  best: dict[str, dict] = {}
  fused = False  # values inside a fusion are never materialised
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      fused = "fused" in header.group(1) or "region" in header.group(1)
      continue
    m = None if fused else _VALUE.search(line)
    if not m or m.group(1) not in _DTYPE_BYTES or m.group(3) == "parameter":
      continue
    dims = [int(d) for d in m.group(2).split(",")]
    nbytes = math.prod(dims) * _DTYPE_BYTES[m.group(1)]
    shape = f"{m.group(1)}[{m.group(2)}]"
    if shape not in best:
      op_name = re.search(r'op_name="([^"]*)"', line)
      best[shape] = {
          "shape": shape,
          "bytes": nbytes,
          "op": m.group(3),
          "source": op_name.group(1)[-120:] if op_name else ""
      }
  return sorted(best.values(), key=lambda v: -v["bytes"])[:count]

"""What runs under each asynchronous collective of a compiled (scheduled) XLA program.

A compiled module's text lists every computation's instructions in schedule order. An
asynchronous collective is a `*-start` / `*-done` pair (`all-to-all-start`,
`all-gather-start`, or a generic `async-start` that calls the collective); whatever the
schedule places between the two runs while the transfer is in flight. `overlap_windows`
lists, for every such pair, the collective and the compute placed inside its window, so
a benchmark can show that chunk i+1's all-to-all runs under chunk i's expert matmuls.
Synchronous collectives (XLA:CPU's) appear with `asynchronous=False` and empty windows.
"""

from __future__ import annotations

import collections
import dataclasses
import re

COLLECTIVES = ("ragged-all-to-all", "all-to-all", "all-gather", "all-reduce", "reduce-scatter",
               "collective-permute")
# Instructions that do work on the device (everything else is bookkeeping: tuples,
# bitcasts, parameters, constants, get-tuple-element, the async pairs themselves).
_COMPUTE = ("fusion", "custom-call", "dot", "convolution", "while", "conditional", "call")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_COMMENT = re.compile(r"/\*.*?\*/")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  opcode: str
  rest: str  # operands and attributes


@dataclasses.dataclass
class Window:
  collective: str  # all-to-all, all-gather, ...
  computation: str
  start: str
  asynchronous: bool
  compute: list[str]  # compute instructions scheduled between start and done

  @property
  def matmuls(self) -> list[str]:
    """The compute in the window that multiplies matrices (cuBLAS, Triton or Mosaic
    kernels: the custom calls and the fusions whose name says gemm/dot)."""
    return [c for c in self.compute if re.search(r"gemm|dot|mosaic|triton|cublas", c)]

  @property
  def kernels(self) -> list[str]:
    """Custom-call targets in the window (`mosaic_gpu_v2` is a Pallas Mosaic GPU kernel,
    e.g. the expert grouped matmul; `__cublas$lt$matmul` a cuBLAS matmul)."""
    return [m.group(1) for c in self.compute for m in [re.search(r"\((.+)\)$", c)] if m]


def computations(hlo_text: str) -> dict[str, list[Instruction]]:
  """{computation name: instructions in schedule order}."""
  out: dict[str, list[Instruction]] = {}
  current = None
  for line in hlo_text.splitlines():
    line = _COMMENT.sub("", line)  # /*index=5*/ markers in long tuples
    if current is None:
      m = _COMPUTATION.match(line)
      if m and "=" not in line.split("{")[0]:
        current = out.setdefault(m.group(1), [])
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if m:
      current.append(Instruction(m.group(1), m.group(3), m.group(4)))
  return out


def _collective_of(inst: Instruction, comps: dict[str, list[Instruction]]) -> str | None:
  if inst.opcode.endswith("-start") and inst.opcode != "async-start":
    kind = inst.opcode[:-len("-start")]
    return kind if kind in COLLECTIVES else None
  if inst.opcode == "async-start":
    called = re.search(r"calls=%?([\w.\-]+)", inst.rest)
    for sub in comps.get(called.group(1), []) if called else []:
      if sub.opcode in COLLECTIVES:
        return sub.opcode
  return None


def _describe(inst: Instruction) -> str:
  target = re.search(r'custom_call_target="([^"]+)"', inst.rest)
  return f"{inst.name} ({target.group(1)})" if target else inst.name


def overlap_windows(hlo_text: str) -> list[Window]:
  """Every collective of the module, with the compute its asynchronous window holds."""
  comps = computations(hlo_text)
  # the bodies of generic async pairs: their collective is the pair's, not another one
  async_bodies = {
      m.group(1) for insts in comps.values() for i in insts if i.opcode == "async-start"
      for m in [re.search(r"calls=%?([\w.\-]+)", i.rest)] if m
  }
  windows = []
  for comp_name, insts in comps.items():
    if comp_name in async_bodies:
      continue
    for i, inst in enumerate(insts):
      if inst.opcode in COLLECTIVES:
        windows.append(Window(inst.opcode, comp_name, inst.name, False, []))
        continue
      kind = _collective_of(inst, comps)
      if kind is None:
        continue
      uses = re.compile(rf"%{re.escape(inst.name)}\b")
      done = next((j for j in range(i + 1, len(insts))
                   if insts[j].opcode.endswith("-done") and uses.search(insts[j].rest)), None)
      inside = insts[i + 1:done] if done is not None else []
      compute = [_describe(x) for x in inside if x.opcode in _COMPUTE]
      windows.append(Window(kind, comp_name, inst.name, True, compute))
  return windows


def summary(windows: list[Window], collective: str = "all-to-all") -> dict:
  """Counts for one collective kind: how many, how many asynchronous, how many of those
  have compute (and matmuls) scheduled under them, and how often each custom-call kernel
  runs under one (so a report can tell the expert kernels from other matmuls)."""
  mine = [w for w in windows if w.collective == collective]
  asynchronous = [w for w in mine if w.asynchronous]
  return {
      "collective":
          collective,
      "count":
          len(mine),
      "asynchronous":
          len(asynchronous),
      "with_compute_inside":
          sum(bool(w.compute) for w in asynchronous),
      "with_matmul_inside":
          sum(bool(w.matmuls) for w in asynchronous),
      "compute_inside":
          sum(len(w.compute) for w in asynchronous),
      "kernels_inside":
          dict(sorted(collections.Counter(k for w in asynchronous for k in w.kernels).items()))
  }

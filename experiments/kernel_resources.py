"""Registers, spills and shared memory of the Pallas kernels of the registered ops (Triton
and Mosaic GPU), compiled for Hopper on any machine: no GPU needed.

    PYTHONPATH=src:. JAX_PLATFORMS=cpu python3 -m experiments.kernel_resources --ops 'linear_*'
    ... --ops linear_attention.kda --option forward=fused    # an option of the op's

Each implementation of an op is lowered for CUDA (forward, and forward+backward where the op
is differentiated, then the forward alone for the kernels only it runs) at the op's `bench`
shapes from experiments.op_checks (shapes only: nothing is allocated). Every Triton kernel in it is compiled for sm_90a with the `triton`
package and assembled by its `ptxas -v`, which gives registers per thread and spill bytes,
and disassembled by its `nvdisasm` for the size of the machine code (a kernel past the SM's
instruction cache, about 128 KiB, stalls on instruction fetches: see docs/kernel_tuning.md,
"Code size"); with the launch's warps and shared memory that gives the programs an SM holds
at once (the H200's limits: 64K registers, 64 warps, 32 programs and 228 KiB of shared
memory per SM).

The lowering takes the path the H200 runs (`on_hopper()` answers yes), so the Mosaic GPU
kernels (the linear-attention state walks, the fused forwards) are lowered for real, not
interpreted: Mosaic GPU's Python lowering runs (layouts, WGMMA operands, its shared-memory
limit of 227 KiB a program) and gives each kernel's threads and shared memory. Their
registers come from the GPU's own compiler, so the table leaves them out.

The GPU's XLA compiles with its own copy of Triton, so read the figures as an estimate
for comparing variants of a kernel: against Nsight Compute on the H200 (2026-11-30),
gla_chunk_key_grads matched (255 registers, 40 KiB shared, 2 programs per SM) and
gla_chunk_score_grads did not (112 registers here, 87 there).

Needs `pip install triton==3.6.0` (the GPU machine's Triton; not a project dependency).
The lowering reaches into JAX's private Pallas Triton lowering, checked against jax
0.11.2.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import fnmatch
import functools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import types
from unittest import mock

import jax
import jax.numpy as jnp

from hylora.ops import catalog
from experiments.op_checks import CHECKS

# Hopper (sm_90) per-SM limits
_REGISTERS_PER_SM = 65536
_REGISTER_GRANULE = 256  # registers are allocated per warp in blocks of 256
_WARPS_PER_SM = 64
_PROGRAMS_PER_SM = 32
_SHARED_PER_SM = 233472  # 228 KiB
_SHARED_RESERVED = 1024  # per program, by the driver


@dataclasses.dataclass(frozen=True)
class Kernel:
  name: str
  num_warps: int
  num_stages: int
  ttir: str  # the Triton IR Pallas hands to XLA, as text ("" for a Mosaic GPU kernel)
  mosaic_shared: int | None = None  # a Mosaic GPU kernel's shared memory, bytes

  @property
  def is_mosaic(self) -> bool:
    return self.mosaic_shared is not None


def _as_on_hopper():
  """Patches every loaded `on_hopper` (pallas_kernels' choice of the Mosaic GPU kernels)
    to answer yes."""
  from pallas_kernels.linear_attention import _mosaic_common
  original = _mosaic_common.on_hopper
  holders = [m for m in list(sys.modules.values()) if getattr(m, "on_hopper", None) is original]
  return [mock.patch.object(m, "on_hopper", lambda: True) for m in holders]


@contextlib.contextmanager
def _lowering_for_cuda(kernels: list[Kernel]):
  """Lets the Pallas Triton and Mosaic GPU lowerings run without a GPU (compute capability
    9.0), on the path a Hopper GPU takes, and records each kernel they emit."""
  from jax._src.pallas.triton import lowering
  from jax._src.pallas.triton import pallas_call_registration as registration
  from jax.experimental.mosaic.gpu import core as mosaic

  modules = []
  lower_mosaic = mosaic._lower_as_gpu_kernel

  def recording_mosaic(body, grid, cluster, block, in_shapes, out_shape, inout_shape,
                       smem_scratch_shape, *args, **kwargs):
    result = lower_mosaic(body, grid, cluster, block, in_shapes, out_shape, inout_shape,
                          smem_scratch_shape, *args, **kwargs)
    name = kwargs.get("kernel_name", args[2] if len(args) > 2 else "mosaic_gpu")
    kernels.append(
        Kernel(name,
               math.prod(block) // 32, 0, "",
               mosaic_shared=mosaic._smem_tree_size(smem_scratch_shape)))
    return result

  lower_module = lowering.lower_jaxpr_to_triton_module
  custom_call = registration.mlir.custom_call

  def recording_lower(*args, **kwargs):
    result = lower_module(*args, **kwargs)
    modules.append(result.module.operation.get_asm())
    return result

  def recording_call(*args, backend_config=None, **kwargs):
    target = kwargs.get("call_target_name", args[0] if args else None)
    if target == "__gpu$xla.gpu.triton":
      cfg = backend_config
      kernels.append(
          Kernel(cfg["name"].value, cfg["num_warps"].value, cfg["num_stages"].value, modules[-1]))
    return custom_call(*args, backend_config=backend_config, **kwargs)

  gpu = types.SimpleNamespace(compute_capability=90)  # as jax.pallas.triton.gpu_info gives it
  with contextlib.ExitStack() as stack:
    for patch in [
        mock.patch.object(registration, "gpu_info_lib",
                          types.SimpleNamespace(get_gpu_info=lambda: gpu)),
        mock.patch.object(lowering, "lower_jaxpr_to_triton_module", recording_lower),
        mock.patch.object(registration.mlir, "custom_call", recording_call),
        mock.patch.object(mosaic, "_lower_as_gpu_kernel", recording_mosaic),
        mock.patch.object(jax, "default_backend", lambda: "gpu"),  # compiled, not interpreted
        *_as_on_hopper()
    ]:
      stack.enter_context(patch)
    yield


def _input_shapes(check, size):
  """(args, kwargs) of the op's check at `size`, arrays as ShapeDtypeStructs."""
  static = {}

  def build(key):
    args, kwargs = check.make_inputs(key, size)
    # arrays and pytrees of them (a DecayGate) are traced; the rest is static
    arrays = {
        k: v for k, v in kwargs.items() if any(
            isinstance(x, jax.Array) for x in jax.tree.leaves(v))
    }
    static.update({k: v for k, v in kwargs.items() if k not in arrays})
    return args, arrays

  args, arrays = jax.eval_shape(build, jax.random.key(0))
  return args, arrays, static


FORWARD_ALONE = " (forward alone)"  # the name's suffix of a kernel only the forward alone runs


def capture_kernels(op: str, impl: str, size: str = "bench", **options) -> list[Kernel]:
  """The Triton and Mosaic GPU kernels one implementation of an op runs on Hopper
    (forward, then backward), each once, then those its forward alone runs and the
    backward's forward does not (an op's inference path: the KDA walk that applies T
    itself, a fused forward without the backward's states), their names ending in
    FORWARD_ALONE; `options` go to the op beside its check's."""
  check = CHECKS[op]
  args, arrays, static = _input_shapes(check, size)
  fn = functools.partial(catalog().resolve(op, impl), **static, **options)
  # an option replaces the check's argument of its name (decay=None: g taken as the decays)
  arrays = {name: a for name, a in arrays.items() if name not in options}

  def forward(args, arrays):
    return fn(*args, **arrays)

  def forward_and_backward(args, arrays):
    loss = lambda *a: sum(
        jnp.sum(x.astype(jnp.float32))
        for x in jax.tree.leaves(fn(*a, **arrays))
        if jnp.issubdtype(x.dtype, jnp.floating))
    return jax.value_and_grad(loss, check.grad_argnums)(*args)  # the value keeps the forward

  def lowered(run):
    kernels: list[Kernel] = []
    with _lowering_for_cuda(kernels):
      jax.jit(run).trace(args, arrays).lower(lowering_platforms=("cuda",))
    return {(k.name, k.ttir, k.mosaic_shared): k for k in kernels}

  if not check.grad_argnums:
    return list(lowered(forward).values())
  trained = lowered(forward_and_backward)
  alone = [
      dataclasses.replace(k, name=k.name + FORWARD_ALONE)
      for key, k in lowered(forward).items()
      if key not in trained
  ]
  return list(trained.values()) + alone


def parse_ptxas(report: str) -> dict:
  """Registers per thread and spill/stack bytes from `ptxas -v` output."""

  def number(pattern):
    found = re.findall(pattern, report)
    if not found:
      raise ValueError(f"no {pattern!r} in the ptxas report:\n{report}")
    return int(found[-1])

  return {
      "registers": number(r"Used (\d+) registers"),
      "spill_stores": number(r"(\d+) bytes spill stores"),
      "spill_loads": number(r"(\d+) bytes spill loads"),
      "stack": number(r"(\d+) bytes stack frame")
  }


def programs_per_sm(registers: int, num_warps: int, shared_bytes: int) -> int:
  """Programs (CUDA blocks) of one kernel an SM runs at once."""
  per_warp = -(-registers * 32 // _REGISTER_GRANULE) * _REGISTER_GRANULE
  by_registers = _REGISTERS_PER_SM // (per_warp * num_warps)
  by_shared = _SHARED_PER_SM // (shared_bytes + _SHARED_RESERVED)
  return min(by_registers, by_shared, _WARPS_PER_SM // num_warps, _PROGRAMS_PER_SM)


def register_cap_for(programs: int, num_warps: int) -> int:
  """The most registers per thread that still fit `programs` programs on an SM."""
  per_warp = _REGISTERS_PER_SM // (programs * num_warps)
  return min(255, per_warp // _REGISTER_GRANULE * _REGISTER_GRANULE // 32)


def _ptxas(ptxas, ptx, path, max_registers=None):
  """ptxas -v's report on the PTX (written to path), optionally capped with .maxnreg."""
  if max_registers is not None:  # as a PTX directive: ptxas ignored --maxrregcount here
    ptx = re.sub(r"(\.reqntid [^\n]*\n)", rf"\1.maxnreg {max_registers}\n", ptx, count=1)
  with open(path, "w") as f:
    f.write(ptx)
  return subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull],
                        capture_output=True, text=True, check=True).stderr


# An instruction line of `nvdisasm -c`: indented, its address in a comment, e.g.
# "        /*0070*/                   LDC R1, c[0x0][0x28] ;"
_SASS_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/")
SASS_INSTRUCTION_BYTES = 16  # every sm_90 instruction


def code_bytes(listing: str) -> int:
  """Bytes of machine code in an `nvdisasm -c` listing (its instructions, 16 bytes each)."""
  return SASS_INSTRUCTION_BYTES * sum(
      1 for line in listing.splitlines() if _SASS_INSTRUCTION.match(line))


def compile_for_hopper(kernel: Kernel) -> dict:
  """ptxas's registers and spills, Triton's shared memory, the bytes of machine code, the
    programs per SM, and the spill bytes if capped at the registers that would fit one
    program more per SM."""
  try:
    import triton
    from triton.backends.compiler import GPUTarget
  except ImportError:
    sys.exit("kernel_resources needs the triton package: pip install triton==3.6.0")
  with tempfile.TemporaryDirectory() as tmp:
    ttir = os.path.join(tmp, f"{kernel.name}.ttir")
    with open(ttir, "w") as f:
      f.write(kernel.ttir)
    compiled = triton.compile(
        ttir, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=kernel.num_warps,
                                                             num_stages=kernel.num_stages))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    ptx, path = compiled.asm["ptx"], os.path.join(tmp, f"{kernel.name}.ptx")
    out = parse_ptxas(_ptxas(ptxas, ptx, path)) | {"shared": compiled.metadata.shared}
    cubin = os.path.join(tmp, f"{kernel.name}.cubin")
    with open(cubin, "wb") as f:
      f.write(compiled.asm["cubin"])
    out["code"] = code_bytes(
        subprocess.run([os.path.join(os.path.dirname(ptxas), "nvdisasm"), "-c", cubin],
                       capture_output=True, text=True, check=True).stdout)
    out["programs_per_sm"] = programs_per_sm(out["registers"], kernel.num_warps, out["shared"])
    out["occupancy"] = out["programs_per_sm"] * kernel.num_warps / _WARPS_PER_SM
    more = out["programs_per_sm"] + 1
    cap = register_cap_for(more, kernel.num_warps)
    if cap >= 24 and programs_per_sm(cap, kernel.num_warps, out["shared"]) == more:
      capped = parse_ptxas(_ptxas(ptxas, ptx, path, cap))
      out["next_step"] = {"registers": cap, "spill_bytes": capped["spill_stores"]}
  return out


def mosaic_resources(kernel: Kernel) -> dict:
  """A Mosaic GPU kernel's shared memory and the programs an SM holds by it and by warps
    (its registers are the GPU compiler's: unknown here)."""
  shared = kernel.mosaic_shared
  programs = min(_SHARED_PER_SM // (shared + _SHARED_RESERVED), _WARPS_PER_SM // kernel.num_warps,
                 _PROGRAMS_PER_SM)
  return {"shared": shared, "programs_per_sm": programs}


def _option(text: str) -> tuple[str, object]:
  """KEY=VALUE, the value a Python literal where it parses as one, else the string."""
  key, sep, value = text.partition("=")
  if not sep or not key:
    raise argparse.ArgumentTypeError(f"--option {text!r}: expected KEY=VALUE")
  try:
    return key, ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return key, value


# Straight-line kernels past about this much code ran 1.4-2x slower than their parts as
# separate kernels on the H100 (docs/kernel_tuning.md, "Code size"): flagged in the table
INSTRUCTION_CACHE_BYTES = 128 * 1024


def code_note(code: int) -> str:
  return " (over the instruction cache)" if code > INSTRUCTION_CACHE_BYTES else ""


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--ops", nargs="*", default=None, help="op name patterns (default: all)")
  p.add_argument("--size", choices=("small", "bench"), default="bench")
  p.add_argument("--out", default=None, help="a JSON file for the rows")
  p.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                 help="passed to every op lowered (e.g. forward=fused for linear_attention.kda)")
  a = p.parse_args()
  options = dict(a.option)
  rows = []
  print("| op | implementation | kernel | warps | stages | registers | spill bytes "
        "(stores / loads) | shared KiB | code KiB | programs per SM | occupancy | one program "
        "more per SM: register cap, spill bytes |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  for op in catalog().names():
    if op not in CHECKS or (a.ops and not any(fnmatch.fnmatch(op, pat) for pat in a.ops)):
      continue
    for impl in sorted(catalog().entry(op).impls):  # the fast ones, not the reference
      try:
        kernels = capture_kernels(op, impl, a.size, **options)
      except Exception as e:  # an implementation that cannot lower here: say so
        print(
            f"| {op} | {impl} | not lowered: {type(e).__name__}: "
            f"{str(e).splitlines()[0][:120]} | | | | | | | | | |", flush=True)
        continue
      if not kernels:
        print(f"| {op} | {impl} | no Pallas kernels | | | | | | | | | |", flush=True)
      for k in kernels:
        if k.is_mosaic:
          r = mosaic_resources(k)
          rows.append({"op": op, "impl": impl, "kernel": k.name, "num_warps": k.num_warps} | r)
          print(
              f"| {op} | {impl} | {k.name} (Mosaic GPU) | {k.num_warps} | - | - | - | "
              f"{r['shared'] / 1024:.0f} | - | {r['programs_per_sm']} | - | - |", flush=True)
          continue
        r = compile_for_hopper(k)
        rows.append({
            "op": op,
            "impl": impl,
            "kernel": k.name,
            "num_warps": k.num_warps,
            "num_stages": k.num_stages
        } | r)
        step = r.get("next_step")
        step = f"{step['registers']}, {step['spill_bytes']}" if step else "-"
        print(
            f"| {op} | {impl} | {k.name} | {k.num_warps} | {k.num_stages} | "
            f"{r['registers']} | {r['spill_stores']} / {r['spill_loads']} | "
            f"{r['shared'] / 1024:.0f} | {r['code'] / 1024:.0f}{code_note(r['code'])} | "
            f"{r['programs_per_sm']} | {r['occupancy']:.1%} | {step} |", flush=True)
  if a.out:
    with open(a.out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()

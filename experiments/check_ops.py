"""Check every registered op: precision of each implementation against the reference in
higher precision, forward and backward, and (on GPU) its speed next to the reference.

  python -m experiments.check_ops                       # every op; CPU: small shapes
  python -m experiments.check_ops --ops 'linear_*' --out runs/check_ops
  python -m experiments.check_ops --size bench          # the gpu-1 shapes (one H200)

For each op the ground truth is the reference run on fp32 copies of the inputs with the
highest matmul precision. Every implementation (the reference itself included) then runs
on the op's declared inputs and dtypes; the table shows the relative RMS error and the
max error (max |x - truth| / max |truth|) of the outputs and of the gradients of a fixed
random projection of the outputs, against the op's declared tolerances. Integer outputs
(top-K indices, token counts) must match exactly. Implementations declared for GPU only
run here too: Pallas kernels are interpreted on CPU. Exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments.op_checks import CHECKS, OpCheck, max_tolerances
from hylora.ops import OpRegistry, catalog

# The checks are dominated by XLA:CPU compile time; cheap codegen keeps CI fast.
_FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@dataclasses.dataclass
class Result:
  op: str
  impl: str
  status: str  # "pass", "FAIL", "error", "unchecked"
  fwd_rms: float | None = None
  fwd_max: float | None = None
  bwd_rms: float | None = None
  bwd_max: float | None = None
  fwd_tol: tuple[float, float] | None = None  # (rel RMS, max)
  bwd_tol: tuple[float, float] | None = None
  fwd_ms: float | None = None
  step_ms: float | None = None  # forward + backward
  note: str = ""

  @property
  def ok(self) -> bool:
    return self.status == "pass"


def _jit(fn):
  if jax.default_backend() == "cpu":
    return jax.jit(fn, compiler_options=_FAST_CPU_COMPILE)
  return jax.jit(fn)


def _upcast(tree):
  """fp32 copies of the floating-point leaves below fp32 (the ground truth's inputs)."""

  def up(x):
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating) \
        and x.dtype.itemsize < 4:
      return x.astype(jnp.float32)
    return x

  return jax.tree.map(up, tree)


def _is_float(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


class _Program:
  """An op implementation bound to fixed inputs: forward, and forward + gradients of
  sum(output * projection) with respect to `grad_argnums`, each one jitted program."""

  def __init__(self, fn, args, kwargs, grad_argnums, projections):
    self.array_pos = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]
    self.arrays = [args[i] for i in self.array_pos]
    self.grad_pos = [self.array_pos.index(i) for i in grad_argnums]

    def call(*arrays):
      full = list(args)
      for i, a in zip(self.array_pos, arrays):
        full[i] = a
      return fn(*full, **kwargs)

    def projected(*arrays):
      out = jax.tree.leaves(call(*arrays))
      return sum(
          jnp.sum(o.astype(jnp.float32) * p) for o, p in zip(out, projections) if p is not None)

    def forward_and_gradients(*arrays):
      if not self.grad_pos:
        return call(*arrays), ()
      out, pullback = jax.vjp(lambda *diff: call(*self._fill(arrays, diff)),
                              *(arrays[i] for i in self.grad_pos))
      seeds = [
          jnp.zeros(o.shape, jax.dtypes.float0) if p is None else p.astype(o.dtype)
          for o, p in zip(jax.tree.leaves(out), projections)
      ]
      return out, pullback(jax.tree.unflatten(jax.tree.structure(out), seeds))

    self.call, self.projected = call, projected
    self.both = _jit(forward_and_gradients)

  def _fill(self, arrays, diff):
    arrays = list(arrays)
    for i, d in zip(self.grad_pos, diff):
      arrays[i] = d
    return arrays

  def run(self):
    """(outputs, gradients) from one compiled program."""
    return jax.block_until_ready(self.both(*self.arrays))

  def time_ms(self, repeats: int) -> tuple[float, float | None]:
    """Median (forward ms, forward + backward ms) after a warm-up run."""

    def median(f):
      jax.block_until_ready(f(*self.arrays))
      times = []
      for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(*self.arrays))
        times.append((time.perf_counter() - start) * 1e3)
      return statistics.median(times)

    step = (_jit(jax.value_and_grad(self.projected, argnums=tuple(self.grad_pos)))
            if self.grad_pos else None)
    return median(_jit(self.call)), (median(step) if step else None)


def _set_mismatch(got: np.ndarray, truth: np.ndarray) -> float:
  """The fraction of entries in which a row of `got` and the same row of `truth` differ
  as sets (rows along the last axis are order-free, e.g. selected key indices); checked
  both ways, so a duplicated entry cannot hide a missing one."""
  g, t = got.reshape(-1, got.shape[-1]), truth.reshape(-1, truth.shape[-1])
  if not g.size:
    return 0.0
  missing = sum(
      max(int(np.sum(~np.isin(gr, tr))), int(np.sum(~np.isin(tr, gr)))) for gr, tr in zip(g, t))
  return missing / g.size


def _errors(got, truth, index_sets: bool) -> tuple[float, float]:
  """(max over leaves of relative RMS error, max over leaves of max error).

  Integer leaves: the fraction of entries that differ (or, for order-free index sets,
  that are missing from the truth's row), reported in both columns.
  """
  rms, mx = 0.0, 0.0
  for g, t in zip(jax.tree.leaves(got), jax.tree.leaves(truth)):
    g, t = np.asarray(g), np.asarray(t)
    if g.shape != t.shape:
      return float("inf"), float("inf")
    if not np.issubdtype(t.dtype, np.floating):
      wrong = _set_mismatch(g, t) if index_sets and t.ndim else (float(np.mean(
          g != t)) if t.size else 0.0)
      rms, mx = max(rms, wrong), max(mx, wrong)
      continue
    g, t = g.astype(np.float64), t.astype(np.float64)
    if not np.all(np.isfinite(g)):
      return float("inf"), float("inf")
    scale_rms = np.sqrt(np.mean(t * t)) or 1.0
    scale_max = np.max(np.abs(t)) or 1.0
    rms = max(rms, float(np.sqrt(np.mean((g - t)**2)) / scale_rms))
    mx = max(mx, float(np.max(np.abs(g - t)) / scale_max))
  return rms, mx


def check_op(name: str, size: str, *, timing: bool, repeats: int = 10, seed: int = 0,
             registry: OpRegistry | None = None,
             checks: dict[str, OpCheck] | None = None) -> list[Result]:
  """One Result per implementation of op `name` (the reference first); `registry` and
  `checks` default to the catalog and `experiments.op_checks.CHECKS`."""
  entry = (registry or catalog()).entry(name)
  spec = (CHECKS if checks is None else checks).get(name)
  if spec is None:
    return [Result(name, "-", "unchecked", note="no OpCheck in experiments/op_checks.py")]
  args, kwargs = spec.make_inputs(jax.random.key(seed), size)
  fwd_max_tol, bwd_max_tol = max_tolerances(spec)
  fwd_tol, bwd_tol = (spec.fwd_rtol, fwd_max_tol), (spec.bwd_rtol, bwd_max_tol)
  index_sets = spec.index_sets

  reference = entry.reference.load()
  t_args, t_kwargs = _upcast(args), _upcast(kwargs)
  shapes = jax.eval_shape(lambda *a: reference(*a, **t_kwargs), *t_args)
  keys = jax.random.split(jax.random.key(seed + 1), max(1, len(jax.tree.leaves(shapes))))
  projections = [
      jax.random.normal(k, s.shape, jnp.float32) if _is_float(s) else None
      for k, s in zip(keys, jax.tree.leaves(shapes))
  ]
  with jax.default_matmul_precision("highest"):
    truth = _Program(reference, t_args, t_kwargs, spec.grad_argnums, projections).run()

  results = []
  for impl in [entry.reference, *entry.impls.values()]:
    res = Result(name, impl.name, "pass", fwd_tol=fwd_tol,
                 bwd_tol=bwd_tol if spec.grad_argnums else None)
    try:
      program = _Program(impl.load(), args, kwargs, spec.grad_argnums, projections)
      out, grads = program.run()
      res.fwd_rms, res.fwd_max = _errors(out, truth[0], index_sets)
      if spec.grad_argnums:
        res.bwd_rms, res.bwd_max = _errors(grads, truth[1], False)
      if timing:
        res.fwd_ms, res.step_ms = program.time_ms(repeats)
    except Exception as e:  # an implementation that fails to run is a failed check
      res.status, res.note = "error", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
      results.append(res)
      continue
    within = res.fwd_rms <= fwd_tol[0] and res.fwd_max <= fwd_tol[1]
    if spec.grad_argnums:
      within = within and res.bwd_rms <= bwd_tol[0] and res.bwd_max <= bwd_tol[1]
    res.status = "pass" if within else "FAIL"
    if jax.default_backend() == "cpu" and impl.backends == ("gpu",):
      res.note = "GPU impl run on CPU (Pallas interpreted / XLA fallback)"
    results.append(res)
  return results


def select_ops(patterns: list[str] | None, registry: OpRegistry | None = None) -> list[str]:
  names = (registry or catalog()).names()
  if not patterns:
    return names
  chosen = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
  if not chosen:
    raise ValueError(f"--ops {patterns} matches no registered op; ops: {names}")
  return chosen


def check_all(patterns: list[str] | None = None, size: str | None = None, *,
              timing: bool | None = None, repeats: int = 10, progress=None,
              registry: OpRegistry | None = None,
              checks: dict[str, OpCheck] | None = None) -> list[Result]:
  """Results for every op matching `patterns` (fnmatch; None: all)."""
  on_gpu = jax.default_backend() == "gpu"
  size = size or ("bench" if on_gpu else "small")
  timing = on_gpu if timing is None else timing
  results = []
  for name in select_ops(patterns, registry):
    if progress:
      progress(name)
    results.extend(
        check_op(name, size, timing=timing, repeats=repeats, registry=registry, checks=checks))
  return results


def _num(x, fmt="{:.1e}") -> str:
  return "-" if x is None else fmt.format(x)


def _rows(results: list[Result]) -> tuple[list[str], list[list[str]]]:
  ref_ms = {(r.op): (r.fwd_ms, r.step_ms) for r in results if r.impl == "reference"}
  header = [
      "op", "impl", "status", "fwd rel-RMS", "fwd max", "bwd rel-RMS", "bwd max",
      "tol fwd (rms/max)", "tol bwd (rms/max)", "fwd ms", "fwd+bwd ms", "vs ref", "note"
  ]
  rows = []
  for r in results:
    speed = "-"
    ref = ref_ms.get(r.op)
    if ref and r.impl != "reference":
      t, t_ref = (r.step_ms, ref[1]) if r.step_ms and ref[1] else (r.fwd_ms, ref[0])
      if t and t_ref:
        speed = f"{t_ref / t:.2f}x"
    tol = lambda t: "-" if t is None else f"{t[0]:.0e}/{t[1]:.0e}"
    rows.append([
        r.op, r.impl, r.status,
        _num(r.fwd_rms),
        _num(r.fwd_max),
        _num(r.bwd_rms),
        _num(r.bwd_max),
        tol(r.fwd_tol),
        tol(r.bwd_tol),
        _num(r.fwd_ms, "{:.3f}"),
        _num(r.step_ms, "{:.3f}"), speed, r.note
    ])
  return header, rows


def format_table(results: list[Result]) -> str:
  header, rows = _rows(results)
  widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
  line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
  return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def to_markdown(results: list[Result], title: str) -> str:
  header, rows = _rows(results)
  out = [
      f"# {title}", "", "| " + " | ".join(header) + " |",
      "|" + "|".join("---" for _ in header) + "|"
  ]
  out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
  return "\n".join(out) + "\n"


def write_reports(results: list[Result], out_dir: str | Path, size: str) -> None:
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  meta = {
      "backend": jax.default_backend(),
      "device": str(jax.devices()[0].device_kind),
      "size": size,
      "jax": jax.__version__,
      "failures": sum(not r.ok for r in results)
  }
  (out / "check_ops.json").write_text(
      json.dumps({
          **meta, "results": [dataclasses.asdict(r) for r in results]
      }, indent=2) + "\n")
  title = f"Op checks ({meta['backend']}, {meta['device']}, size {size})"
  (out / "check_ops.md").write_text(to_markdown(results, title))


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m experiments.check_ops",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--ops", nargs="*", default=None, help="op name patterns (default: all)")
  p.add_argument("--size", choices=("small", "bench"), default=None,
                 help="input shapes (default: bench on GPU, small elsewhere)")
  p.add_argument("--out", default=None, help="folder for check_ops.json and check_ops.md")
  p.add_argument("--time", dest="timing", action="store_true", default=None,
                 help="time every implementation (default: on GPU only)")
  p.add_argument("--repeats", type=int, default=10, help="timed runs per implementation")
  args = p.parse_args(argv)
  try:
    names = select_ops(args.ops)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  size = args.size or ("bench" if jax.default_backend() == "gpu" else "small")
  start = time.perf_counter()
  results = check_all(names, size, timing=args.timing, repeats=args.repeats,
                      progress=lambda n: print(f"checking {n} ...", file=sys.stderr, flush=True))
  print(format_table(results))
  failures = [r for r in results if not r.ok]
  print(f"\n{len(results) - len(failures)}/{len(results)} checks passed "
        f"({jax.default_backend()}, size {size}, {time.perf_counter() - start:.0f} s)")
  if args.out:
    write_reports(results, args.out, size)
    print(f"reports: {args.out}/check_ops.json, {args.out}/check_ops.md")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())

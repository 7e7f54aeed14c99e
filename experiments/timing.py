"""One timing policy for every benchmark in experiments/.

    from experiments.timing import interleaved_ratios, median_ms

* `median_ms(fn, *args, warmup=1, reps=10)`: a figure on its own. Untimed first: one
  call (it compiles a jitted function; autotuning happens there too), then `warmup` more
  calls (at least one). Then `reps` timed calls, each until its outputs are ready; the
  median in milliseconds.
* `interleaved_ratios(candidates, baseline, *args, rounds=15, calls=10)`: a comparison.
  The baseline and every candidate are timed in alternating rounds in the same process
  (each warmed up as above first), so that clock ramps, thermal drift and other jobs
  between separately timed runs cancel out of the ratio. Reports each side's median
  milliseconds per call and, per candidate, the median, min and max over the rounds of
  baseline time / candidate time (> 1: the candidate is faster).

A comparison counts only from one run that holds both sides: take ratios from
`interleaved_ratios`, not from two `median_ms` figures of different runs.

"Ready" means `jax.block_until_ready` on the outputs; where an output holds PyTorch
tensors (a peer such as fla or Liger run in the same process) the CUDA device is
synchronised too (`block`). Peers are optional: `peer` imports one and reports it as
missing when it is not installed, `to_torch` hands a JAX array to PyTorch without a copy.
JAX itself is imported on first use, so that importing this module starts no backend.
"""

from __future__ import annotations

import statistics
import sys
import time

RESERVED = ("baseline_ms", "baseline_round_ms", "rounds", "calls")


def block(out):
  """Wait until `out` (any pytree of JAX arrays, PyTorch tensors or other values) is
    computed."""
  import jax
  jax.block_until_ready(out)
  torch = sys.modules.get("torch")
  if torch is not None and any(
      isinstance(leaf, torch.Tensor) and leaf.is_cuda for leaf in jax.tree_util.tree_leaves(out)):
    torch.cuda.synchronize()
  return out


def _warm_up(fn, args, warmup):
  if warmup < 1:
    raise ValueError(f"warmup={warmup}: at least one untimed call after the first")
  for _ in range(1 + warmup):  # the first call compiles
    block(fn(*args))


def median_ms(fn, *args, warmup=1, reps=10):
  """Median wall-clock milliseconds of `reps` calls of fn(*args), each timed until its
    outputs are ready, after one untimed first call (compilation) and `warmup` more."""
  if reps < 1:
    raise ValueError(f"reps={reps}: at least one timed call")
  _warm_up(fn, args, warmup)
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    block(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def interleaved_ratios(candidates, baseline, *args, rounds=15, calls=10, warmup=1):
  """Time `baseline` and each of `candidates` ({name: fn}) in alternating rounds, all
    called with `args` (pass closures and no args where the sides take different inputs).

    Each side is warmed up as in `median_ms`. A round times every side once: `calls`
    calls dispatched back to back, then one wait for all their outputs; the baseline
    goes first in even rounds and last in odd ones. Returns

        {"rounds": rounds, "calls": calls, "baseline_ms": median ms per call,
         "baseline_round_ms": [ms per call in each round],
         name: {"ms": ..., "median": r, "min": r, "max": r, "round_ms": [...]}, ...}

    with r over the rounds of baseline time / candidate time (> 1: the candidate is
    faster than the baseline)."""
  if rounds < 1 or calls < 1:
    raise ValueError(f"rounds={rounds}, calls={calls}: at least one of each")
  clash = [name for name in candidates if name in RESERVED]
  if clash:
    raise ValueError(f"candidate names {clash} are taken by the report's own keys")
  sides = {None: baseline, **candidates}  # None: the baseline, no name of a candidate
  for fn in sides.values():
    _warm_up(fn, args, warmup)
  times = {name: [] for name in sides}
  order = list(sides)
  for i in range(rounds):
    for name in order if i % 2 == 0 else order[::-1]:
      fn = sides[name]
      start = time.perf_counter()
      block([fn(*args) for _ in range(calls)])
      times[name].append(time.perf_counter() - start)
  # The ratios come from the reported per-round times, so that median_ratio over a
  # report agrees with the report's own medians to the last digit.
  round_ms = {name: [round(t / calls * 1e3, 4) for t in ts] for name, ts in times.items()}
  out = {
      "rounds": rounds,
      "calls": calls,
      "baseline_ms": round(statistics.median(round_ms[None]), 4),
      "baseline_round_ms": round_ms[None]
  }
  for name in candidates:
    ratios = [b / c for b, c in zip(round_ms[None], round_ms[name])]
    out[name] = {
        "ms": round(statistics.median(round_ms[name]), 4),
        "median": round(statistics.median(ratios), 3),
        "min": round(min(ratios), 3),
        "max": round(max(ratios), 3),
        "round_ms": round_ms[name]
    }
  return out


def median_ratio(report, slower, faster):
  """From one interleaved_ratios report: the median over its rounds of the time of
    `slower` / the time of `faster` (candidate names, or None for the baseline); > 1
    where `faster` is faster."""
  ms = lambda name: report["baseline_round_ms"] if name is None else report[name]["round_ms"]
  return round(statistics.median(a / b for a, b in zip(ms(slower), ms(faster))), 3)


def peer(make):
  """(make(), None) where the peer imports; (None, "missing: ...") where it is not
    installed. `make` imports the peer and returns what the benchmark calls."""
  try:
    return make(), None
  except ImportError as e:
    return None, f"missing: {type(e).__name__}: {str(e)[:160]}"


def failed(e):
  """How a measurement that raised is reported (the benchmark goes on)."""
  return f"failed: {type(e).__name__}: {str(e)[:300]}"


def to_torch(x, requires_grad=False):
  """A JAX array as a PyTorch tensor on the same device (DLPack, no copy; a copy where
    a gradient is asked for, so that the peer owns its leaf)."""
  import torch
  t = torch.from_dlpack(x)
  return t.detach().clone().requires_grad_(True) if requires_grad else t

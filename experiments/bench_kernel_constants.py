"""GPU benchmark: tuning constants of the linear-attention kernels against each other and
jla, in alternating rounds of one process.

    PYTHONPATH=src:. python3 -m experiments.bench_kernel_constants --op kda \
        --shape 1,32768,32,128 --gates logsigmoid_strong kda_init \
        --setting b64:_kda_scores.HALVES_BLOCK_D=64 --setting b128:_kda_scores.HALVES_BLOCK_D=128

A setting is NAME:MODULE.CONSTANT=VALUE[;MODULE.CONSTANT=VALUE...], MODULE a module of
pallas_kernels.linear_attention and VALUE a Python literal; `op.KEYWORD=VALUE` passes a
keyword to the op instead (--setting "in_scores:op.decay_sum='in_scores'"). Each setting's op
(chunked_kda or chunked_gla, with its defaults but the keywords given) is traced and
compiled with its constants in place, which are then restored: the kernels read them at
trace time, so each compiled function keeps its own. Then every setting's forward and
forward+backward (bench_linear_attention's fwd_and_fwdbwd) is timed against jla's
(experiments.timing.interleaved_ratios; without jla, against the first setting). One JSON
line per gate regime: per pass, each setting's median ms and median per-round ratio
(baseline / setting: > 1, the setting faster). With --correctness, first each setting's
output and gradients against the fp32 reference.
"""
import argparse
import ast
import contextlib
import functools
import importlib
import inspect
import json

import jax

from experiments.bench_linear_attention import (CORRECTNESS_SHAPE, GATES, correctness,
                                                fwd_and_fwdbwd, inputs, inputs_at, kda_inputs,
                                                peer_fns)
from experiments.timing import interleaved_ratios

PACKAGE = "pallas_kernels.linear_attention"
# the MODULE of a setting's item that is a keyword of the op, not a module's constant
OP = "op"


def parse_setting(spec):
  """"name:_kda_scores.X=1;_kda_solve.Y=2" -> (name, [(module, "X", 1), (module, "Y", 2)]),
    after checking that every module holds the constant it names."""
  name, sep, body = spec.partition(":")
  if not sep or not name or not body:
    raise ValueError(f"setting {spec!r}: expected NAME:MODULE.CONSTANT=VALUE[;...]")
  patches = []
  for item in filter(None, body.split(";")):
    target, eq, value = item.partition("=")
    module, dot, constant = target.rpartition(".")
    if not (eq and dot):
      raise ValueError(f"setting {spec!r}: {item!r} is not MODULE.CONSTANT=VALUE")
    if module == OP:
      patches.append((OP, constant, ast.literal_eval(value)))
      continue
    mod = importlib.import_module(f"{PACKAGE}.{module}")
    if not hasattr(mod, constant):
      raise ValueError(f"setting {spec!r}: {PACKAGE}.{module} has no {constant}")
    patches.append((mod, constant, ast.literal_eval(value)))
  return name, patches


@contextlib.contextmanager
def patched(patches):
  """The constants set for the block, restored after it (the op's keywords left out)."""
  patches = [(mod, name, value) for mod, name, value in patches if mod != OP]
  saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
  try:
    for mod, name, value in patches:
      setattr(mod, name, value)
    yield
  finally:
    for mod, name, value in saved:
      setattr(mod, name, value)


def traced_under(op, patches):
  """The op (chunked_kda or chunked_gla with its defaults but the patches' keywords), traced
    under the patches' constants wherever it is traced (jitted by a caller)."""
  from pallas_kernels.linear_attention import chunked_gla, chunked_kda
  fn = {"kda": chunked_kda, "gla": chunked_gla}[op]
  keywords = {name: value for mod, name, value in patches if mod == OP}
  known = inspect.signature(fn).parameters
  for name in keywords:
    if known.get(name) is None or known[name].kind != inspect.Parameter.KEYWORD_ONLY:
      raise ValueError(f"op.{name}: {fn.__name__} takes no keyword {name}")

  def op_under_patches(*a):
    with patched(patches):
      return fn(*a, **keywords)

  return op_under_patches


def compiled(op, patches, x):
  """(forward, forward+backward) of the op on x, traced and compiled under the patches, as
    functions of no arguments."""
  fwd, fwdbwd = fwd_and_fwdbwd(traced_under(op, patches), len(x))
  jax.block_until_ready((fwd(*x), fwdbwd(*x)))
  return functools.partial(fwd, *x), functools.partial(fwdbwd, *x)


def check(op, gates, settings, shape=CORRECTNESS_SHAPE):
  """Each setting's output and gradients against the fp32 plain-JAX chunked op, per gate
    regime (bench_linear_attention.correctness: one JSON line per regime and setting, after
    the bf16 reference's own)."""
  from pallas_kernels.linear_attention import gla_chunked, kda_chunked
  reference, make = (kda_chunked, kda_inputs) if op == "kda" else (gla_chunked, inputs_at)
  correctness(op, [(name, traced_under(op, patches)) for name, patches in settings], reference,
              make, gates, shape)


def bench(op, shape, gates, settings, peer=True, rounds=15, calls=10):
  """{gates, shape, fwd: {name: [ms, ratio]}, fwdbwd: ..., baseline}: the settings' ops
    against jla's (or, without it or with peer=False, the first setting's)."""
  x = kda_inputs(shape, gates=gates) if op == "kda" else inputs(*shape, gates=gates)
  sides = {name: compiled(op, patches, x) for name, patches in settings}
  made = peer_fns("jla", op, x) if peer else "not asked"
  baseline = "jla" if not isinstance(made, str) else settings[0][0]
  base = made if baseline == "jla" else sides[baseline]
  row = {"op": op, "shape": list(shape), "gates": gates, "baseline": baseline}
  for i, kind in enumerate(("fwd", "fwdbwd")):
    report = interleaved_ratios({
        n: fns[i] for n, fns in sides.items()
    }, base[i], rounds=rounds, calls=calls)
    row[kind] = {n: [round(report[n]["ms"], 4), report[n]["median"]] for n in sides}
    row[kind]["baseline_ms"] = round(report["baseline_ms"], 4)
  return row


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--op", choices=("kda", "gla"), default="kda")
  ap.add_argument("--shape", type=lambda s: tuple(map(int, s.split(","))),
                  default=(1, 32768, 32, 128))
  ap.add_argument("--gates", nargs="+", choices=GATES, default=["logsigmoid"])
  ap.add_argument(
      "--setting", action="append", type=parse_setting, required=True,
      help="NAME:MODULE.CONSTANT=VALUE[;...] (repeat for each setting; "
      "MODULE op: a keyword of the op)")
  ap.add_argument("--no-peer", action="store_true", help="against the first setting, not jla")
  ap.add_argument("--rounds", type=int, default=15)
  ap.add_argument("--calls", type=int, default=10)
  ap.add_argument(
      "--correctness", action="store_true",
      help="first, each setting's output and gradients against the fp32 reference "
      "(bench_linear_attention's correctness shape)")
  ap.add_argument("--correctness-only", action="store_true", help="--correctness, untimed")
  args = ap.parse_args(argv)
  if args.correctness or args.correctness_only:
    check(args.op, args.gates, args.setting)
  if args.correctness_only:
    return
  for gates in args.gates:
    print(
        json.dumps(
            bench(args.op, args.shape, gates, args.setting, not args.no_peer, args.rounds,
                  args.calls)), flush=True)


if __name__ == "__main__":
  main()

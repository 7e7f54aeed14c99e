"""GPU benchmark: the linear-attention ops of this tree against those of an earlier git
revision, in one process, alternating rounds (a kernel change measured alone).

    PYTHONPATH=src:. python3 -m experiments.bench_linear_attention_revision --revision fba5a83 \
        [--ops kda gla] [--gates logsigmoid_strong kda_init logsigmoid] [--shapes 1,32768,32,128]

The revision's `pallas_kernels/linear_attention` is taken with `git archive` into a
temporary folder and imported under another package name beside this tree's (the rest of
the project is this tree's). Each op runs with its defaults on both sides, on the inputs of
bench_linear_attention (KDA: with beta); one JSON line per op, gate regime and shape, with
each pass's times and the median, min and max of revision / this per round (> 1: this tree
faster).
"""
import argparse
import importlib
import io
import json
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile

from experiments.bench_linear_attention import (GATES, ROUNDS, fwd_and_fwdbwd, inputs, kda_inputs)
from experiments.timing import interleaved_ratios

PACKAGE = "pallas_kernels.linear_attention"
OPS = {"gla": "chunked_gla", "kda": "chunked_kda"}


def import_revision(revision, folder):
  """The linear-attention package as of `revision`, imported as a package of its own
    (written under folder)."""
  try:
    tar = subprocess.run(
        ["git", "archive", revision, PACKAGE.replace(".", "/")], check=True,
        capture_output=True).stdout
  except subprocess.CalledProcessError as e:
    raise SystemExit(f"--revision {revision!r}: git archive failed: "
                     f"{e.stderr.decode().strip().splitlines()[-1]}") from None
  name = "linear_attention_" + re.sub(r"\W", "_", revision)
  root = pathlib.Path(folder)
  with tarfile.open(fileobj=io.BytesIO(tar)) as t:
    t.extractall(root, filter="data")
  source = root / PACKAGE.replace(".", "/")
  target = root / name
  source.rename(target)
  for path in target.rglob("*.py"):
    path.write_text(path.read_text().replace(PACKAGE, name))
  sys.path.insert(0, str(root))
  return importlib.import_module(name)


def compare(op, theirs, ours, shape, gates, rounds):
  """{pass: times and ratios} of ours against theirs (each a function of the op's inputs)."""
  x = kda_inputs(shape, gates=gates) if op == "kda" else inputs(*shape, gates=gates)
  row = {"op": op, "shape": list(shape), "gates": gates}
  for kind, old, new in zip(("fwd", "fwdbwd"), fwd_and_fwdbwd(theirs, len(x)),
                            fwd_and_fwdbwd(ours, len(x))):
    r = interleaved_ratios({"this": lambda: new(*x)}, lambda: old(*x), **rounds)
    row[kind] = {
        "revision_ms": round(r["baseline_ms"], 4),
        "this_ms": r["this"]["ms"],
        "revision_over_this": {
            k: r["this"][k] for k in ("median", "min", "max")
        }
    }
  return row


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--revision", required=True, help="a git revision of this repository")
  p.add_argument("--ops", nargs="+", choices=sorted(OPS), default=sorted(OPS))
  p.add_argument("--gates", nargs="+", choices=GATES, default=list(GATES))
  p.add_argument("--shapes", nargs="+", default=["1,32768,32,128"], help="B,T,H,D")
  p.add_argument("--rounds", type=int, default=21)
  p.add_argument("--calls", type=int, default=ROUNDS["peer"]["calls"])
  a = p.parse_args(argv)
  shapes = [tuple(int(n) for n in s.split(",")) for s in a.shapes]
  if any(len(s) != 4 for s in shapes):
    p.error(f"--shapes {a.shapes}: each B,T,H,D")
  ours = importlib.import_module(PACKAGE)
  with tempfile.TemporaryDirectory() as folder:
    theirs = import_revision(a.revision, folder)
    for op in a.ops:
      for shape in shapes:
        for gates in a.gates:
          row = compare(op, getattr(theirs, OPS[op]), getattr(ours, OPS[op]), shape, gates,
                        dict(rounds=a.rounds, calls=a.calls))
          print(json.dumps({"revision": a.revision} | row), flush=True)


if __name__ == "__main__":
  main()

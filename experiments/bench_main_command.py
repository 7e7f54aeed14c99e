"""The main command's throughput against the planned whole step, in one run.

  python -m experiments.bench_main_command --preset gpu-1 --rounds 2 --steps 8 --out DIR

Each round runs, as subprocesses on this host's first device, the default main command
(`python -m experiments.lora_2p8t --preset P --steps N`: its own plan, data stream,
metrics, checkpoint) and `python -m experiments.bench_step --planned --step-only` (the
compiled step alone, timed back to back under the memory planner's plan); the order
alternates between rounds, and both share a compilation cache, so only the first round
compiles. Tokens/s: the main command's from the median of its per-step times after the
first step (step to step, with everything its loop does), bench_step's from its median
step. Reports each round's ratio (main / planned) and their median: the figure that
counts (experiments/timing.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], log: Path, env: dict) -> None:
  with open(log, "w") as sink:
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, stdout=sink,
                          stderr=subprocess.STDOUT)
  if done.returncode != 0:
    raise SystemExit(f"error: {' '.join(args[:3])} failed (exit {done.returncode}); see {log}")


def main_command_tokens_per_s(preset: str, steps: int, out: Path, env: dict,
                              extra: list[str]) -> tuple[float, dict]:
  _run([
      "experiments.lora_2p8t", "--preset", preset, "--steps",
      str(steps), "--out",
      str(out), "--quiet", *extra
  ], out.with_suffix(".log"), env)
  rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  seconds = statistics.median(r["step_seconds"] for r in rows[1:])
  plan = json.loads((out / "plan.json").read_text())
  return rows[0]["tokens"] / seconds, plan


def planned_step_tokens_per_s(preset: str, steps: int, out: Path, env: dict,
                              extra: list[str]) -> float:
  out.mkdir(parents=True, exist_ok=True)
  args = [
      "experiments.bench_step", "--planned", "--step-only", "--steps",
      str(steps), "--out",
      str(out)
  ]
  if preset != "gpu-1":
    raise SystemExit("error: --preset: bench_step times the gpu-1 preset only")
  _run([*args, *extra], out / "bench_step.log", env)
  return json.loads((out / "bench_step.json").read_text())["tokens_per_s"]


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m experiments.bench_main_command",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="gpu-1")
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--steps", type=int, default=8, help="steps per main-command run")
  p.add_argument("--bench-steps", type=int, default=5, help="timed steps per bench_step run")
  p.add_argument("--out", default="bench_main_command")
  args, extra = p.parse_known_args(argv)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  env = dict(os.environ)
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", ".95")
  env.setdefault("JAX_COMPILATION_CACHE_DIR", str(out.resolve() / "jit-cache"))
  rounds = []
  for r in range(args.rounds):
    sides = {}
    order = ("main", "planned") if r % 2 == 0 else ("planned", "main")
    for side in order:
      if side == "main":
        sides["main"], plan = main_command_tokens_per_s(args.preset, args.steps, out / f"main-{r}",
                                                        env, extra)
      else:
        sides["planned"] = planned_step_tokens_per_s(args.preset, args.bench_steps,
                                                     out / f"planned-{r}", env, extra)
    sides["ratio"] = sides["main"] / sides["planned"]
    rounds.append(sides)
    print(
        f"round {r}: main command {sides['main']:.0f} tokens/s, planned step "
        f"{sides['planned']:.0f} tokens/s, ratio {sides['ratio']:.3f}", flush=True)
  report = {
      "preset": args.preset,
      "rounds": rounds,
      "median_ratio": statistics.median(r["ratio"] for r in rounds),
      "main_plan": plan
  }
  (out / "bench_main_command.json").write_text(json.dumps(report, indent=2) + "\n")
  print(f"median ratio (main command / planned step): {report['median_ratio']:.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

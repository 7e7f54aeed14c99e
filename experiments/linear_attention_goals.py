"""The linear-attention kernels against a peer, as one table, from the JSON rows that
`experiments/bench_linear_attention.py` prints.

    python3 experiments/bench_linear_attention.py --op gla --peers jla ... | tee gla.jsonl
    python3 experiments/bench_linear_attention.py --op kda --peers jla ... | tee kda.jsonl
    python3 -m experiments.linear_attention_goals gla.jsonl kda.jsonl [--peer jla] [--goal 1.0]

One line per (op, gate regime, shape): for the forward and for forward+backward, the
setting of ours with the best median per-round ratio to the peer (peer time / ours, from
the same alternating rounds; > 1: ours faster), its milliseconds and the peer's, and
whether both passes reach the goal. A pass that ours ran and the peer failed (out of
memory at 1M tokens, say) counts as reached, with the peer's error beside our time; a row
where the peer did not run, or our pass failed, says so; lines that are not benchmark rows
(device lists, breakdowns) are skipped.
"""
from __future__ import annotations

import argparse
import json
import sys

PASSES = ("fwd", "fwdbwd")


def best_of_ours(report: dict) -> tuple[str, dict] | None:
  """(setting, its entry) with the highest median ratio in one interleaved_ratios report."""
  ours = {k: v for k, v in report.items() if isinstance(v, dict) and "median" in v}
  if not ours:
    return None
  name = max(ours, key=lambda k: ours[k]["median"])
  return name, ours[name]


def summarize(row: dict, peer: str, goal: float) -> dict | None:
  """One table line from a benchmark row, or None for a line that is not one."""
  if "shape" not in row or "gates" not in row or "kernel_ms" in row:
    return None
  line = {"op": row.get("op", "gla"), "gates": row["gates"], "shape": tuple(row["shape"])}
  if isinstance(row.get(peer), str):
    return line | {"note": f"{peer}: {row[peer]}"}
  met = True
  for kind in PASSES:
    report = row.get(f"vs_{peer}_{kind}")
    best = best_of_ours(report) if isinstance(report, dict) else None
    if best is None:
      why = row.get(f"{peer}_{kind}", "not timed")
      ours = _ours_alone(row, peer, kind)
      if not (isinstance(why, str) and why.startswith("failed") and ours):
        return line | {"note": f"{kind}: {why}"}
      name = min(ours, key=ours.get)
      line[kind] = {"setting": name, "ours_ms": ours[name], "peer_failed": why}
      continue
    name, entry = best
    line[kind] = {
        "setting": name,
        "ours_ms": entry["ms"],
        "peer_ms": report["baseline_ms"],
        "ratio": entry["median"]
    }
    met &= entry["median"] >= goal
  return line | {"met": met}


def _ours_alone(row: dict, peer: str, kind: str) -> dict:
  """{setting: ms} of ours timed alone in one pass (the row's "<setting>_<pass>_ms")."""
  suffix = f"_{kind}_ms"
  return {
      k[:-len(suffix)]: v
      for k, v in row.items()
      if k.endswith(suffix) and k != f"{peer}{suffix}" and isinstance(v, (int, float))
  }


def _pass_cells(entry: dict, peer: str) -> tuple[str, str]:
  """(ms cell, ratio cell) of one pass."""
  if "peer_failed" in entry:  # the error's last clause, e.g. "Out of memory while ..."
    return f"{entry['ours_ms']} / -", f"{peer} failed: " + entry["peer_failed"].split(
        " [")[0].rsplit(": ", 1)[-1][:80]
  return f"{entry['ours_ms']} / {entry['peer_ms']}", f"{entry['ratio']:.2f}x"


def table(lines: list[dict], peer: str, goal: float) -> str:
  head = (f"| op | gates | shape | fwd: ours / {peer} ms | fwd ratio | fwd+bwd: ours / {peer} ms "
          f"| fwd+bwd ratio | >= {goal:g} both | settings (fwd; fwd+bwd) |")
  out = [head, "|" + " --- |" * 9]
  for ln in lines:
    shape = ",".join(map(str, ln["shape"]))
    if "note" in ln:
      out.append(f"| {ln['op']} | {ln['gates']} | {shape} | {ln['note']} | | | | | |")
      continue
    f, b = ln["fwd"], ln["fwdbwd"]
    cells = " | ".join(_pass_cells(f, peer) + _pass_cells(b, peer))
    out.append(f"| {ln['op']} | {ln['gates']} | {shape} | {cells} | "
               f"{'yes' if ln['met'] else 'no'} | {f['setting']}; {b['setting']} |")
  return "\n".join(out)


def read_rows(paths: list[str]) -> list[dict]:
  rows = []
  for path in paths:
    with open(path) as f:
      for text in f:
        text = text.strip()
        if text.startswith("{"):
          try:
            rows.append(json.loads(text))
          except json.JSONDecodeError:
            pass  # a line cut short by a timeout
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("files", nargs="+", help="JSON-lines output of bench_linear_attention.py")
  ap.add_argument("--peer", default="jla")
  ap.add_argument("--goal", type=float, default=1.0, help="the ratio both passes must reach")
  args = ap.parse_args(argv)
  lines = [ln for row in read_rows(args.files) if (ln := summarize(row, args.peer, args.goal))]
  if not lines:
    sys.exit(f"error: no benchmark rows in {', '.join(args.files)}")
  print(table(lines, args.peer, args.goal))
  met = sum(ln.get("met", False) for ln in lines)
  print(f"\n{met} of {len(lines)} lines reach {args.goal:g}x {args.peer} in both passes")


if __name__ == "__main__":
  main()

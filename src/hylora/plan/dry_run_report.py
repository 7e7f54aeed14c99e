"""The dry run's report as text: the summary a person reads (`format_report`) and the
sweep table (`format_sweep`, markdown, for docs and the README)."""

from __future__ import annotations

GB = 1e9


def _gb(x) -> str:
  return "" if x is None else f"{x / GB:9.2f} GB"


def format_report(r: dict) -> str:
  s, b = r["step"], r["bytes_per_device"]
  mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
  lines = [
      f"dry run: preset {r['preset']}, {s['layers']} layers, {r['devices']} simulated "
      f"devices, mesh {mesh}",
      f"  step: batch {s['batch_size']} x seq {s['seq_len']} (grad_accum {s['grad_accum']}), "
      f"batch split {s['batch_spec']} -> {s['tokens_per_device']} tokens per device; "
      f"remat {s['remat']}, dispatch {s['dispatch']}, compiled for {s['backend']}",
  ]
  for line in r.get("stand_ins") or ():
    lines.append(f"  stand-in on XLA:CPU: {line}")
  ideal = s["batch_size"] * s["seq_len"] // r["devices"]
  if s["tokens_per_device"] > ideal:
    lines.append(f"  note: {s['batch_size']} rows cannot be split over {r['devices']} devices, so "
                 f"each device computes {s['tokens_per_device']} tokens, not {ideal} (the "
                 "sequence axis is not sharded); more rows or fewer devices per row fix it")
  lines += ["", f"  {'parameters':<16}{'total':>12}{'active/token':>15}{'LoRA':>12}"]
  for kind, c in r["params_by_kind"].items():
    lines.append(f"  {kind:<16}{c['total']:>12.4g}{c['active']:>15.4g}{c['lora']:>12.4g}")
  lines.append(f"  {'all':<16}{r['params_total']:>12.4g}{r['params_active_per_token']:>15.4g}"
               f"{r['params_lora']:>12.4g}  (LoRA = "
               f"{100 * r['params_lora'] / r['params_total']:.2f}% of total)")
  lines += ["", "  sharding per kind (mesh axes per dimension; split = shards per array):"]
  for kind, layouts in r["shardings"].items():
    for i, lay in enumerate(layouts):
      label = kind if i == 0 else ""
      lines.append(f"  {label:<16}{lay['tree']:<7}{lay['spec']:<32} split {lay['split']:>4}"
                   f"  ({lay['arrays']} arrays)")
  lines += ["", f"  {'bytes per device':<34}{'analytic':>12}{'XLA':>13}"]
  base = r.get("base_format", "none")
  base = "bf16" if base == "none" else f"{base} + bf16"
  for label, key in ((f"base weights ({base})", "weights"), ("LoRA params (fp32)", "lora"),
                     ("LoRA grads (fp32)", "grads"), ("optimizer state", "optimizer"), ("batch",
                                                                                        "batch")):
    lines.append(f"  {label:<34}{_gb(b[key]):>12}")
  lines.append(f"  {'arguments':<34}{_gb(b['analytic_arguments']):>12}"
               f"{_gb(b.get('xla_arguments')):>13}")
  if "xla_outputs" in b:
    lines.append(f"  {'outputs (aliased with inputs)':<34}{'':>12}{_gb(b['xla_outputs']):>13}"
                 f"  ({_gb(b['xla_aliased']).strip()} aliased)")
  lines.append(f"  {'layer-input checkpoints':<34}{_gb(b['analytic_checkpoints']):>12}")
  lines.append(f"  {'temporaries':<34}{'':>12}{_gb(b.get('xla_temporaries')):>13}")
  lines.append(f"  {'peak':<34}{_gb(b['analytic_peak']):>12}{_gb(b.get('xla_peak')):>13}"
               "   (analytic: a lower bound)")
  if r.get("largest_values"):
    lines += ["", "  largest values in the compiled per-device program:"]
    for v in r["largest_values"]:
      lines.append(f"    {v['bytes'] / GB:9.2f} GB  {v['shape']:<28} {v['op']:<10} {v['source']}")
  if r["compiled"]:
    reps = r["partitioner_replications"]
    lines.append("  partitioner: " + (
        "no tensor replicated in full" if not reps else "replicated in full (involuntary): " +
        ", ".join(f"{x['shape']} x{x['count']}" for x in reps)))
  plan = r.get("memory_plan")
  if plan is not None and "error" in plan:
    lines += ["", f"  memory planner failed: {plan['error']}"]
  elif plan is not None:
    lines += [
        "", f"  memory planner (GPU model), remat {plan['policy']}: predicted peak "
        f"{plan['predicted_peak'] / GB:.2f} GB ({'fits' if plan['fits'] else 'does not fit'})"
        f"; its best plan:"
    ]
    lines += ["    " + line for line in plan["best_plan"].splitlines()]
  lines.append("")
  if r["compiled"]:
    lines.append(f"  compile: {r['compile_seconds']:.1f} s (lower + compile of the real step; "
                 f"program {r['program_fingerprint']})")
  else:
    lines.append(f"  compile: skipped (--no-compile); the verdict uses {r['peak_source']}")
  lines.append(f"  peak host memory: {r['host_peak_bytes'] / GB:.2f} GB")
  peak = b[r["peak_source"]]
  verdict = "fits" if r["fits"] else "does NOT fit"
  lines.append(f"verdict: {verdict} in {r['device_memory'] / GB:.1f} GB per device "
               f"({r['peak_source']} {peak / GB:.2f} GB)")
  return "\n".join(lines)


def format_sweep(rows: list[dict], device_memory: float) -> str:

  def gb(x):
    return "-" if x is None else f"{x / GB:.1f}"

  lines = [
      "| variant | seq | batch | tokens/device | remat | XLA temporaries GB | "
      "XLA peak GB | analytic peak GB (lower bound) | planner peak GB (GPU model) | "
      f"fits {device_memory / GB:.0f} GB |", "|" + "---|" * 10
  ]
  for r in rows:
    if "note" in r:  # the resident state alone does not fit: nothing was compiled
      lines.append(f"| {r['variant']} | {r['seq_len']} | {r['batch_size']} | - | {r['remat']} "
                   f"| - | - | - | - | no ({r['note']}) |")
      continue
    lines.append(f"| {r['variant']} | {r['seq_len']} | {r['batch_size']} | "
                 f"{r['tokens_per_device']} | {r['remat']} | {gb(r['xla_temporaries'])} | "
                 f"{gb(r['xla_peak'])} | {gb(r['analytic_peak'])} | {gb(r['planner_peak'])} | "
                 f"{'yes' if r['fits'] else 'no'} |")
  return "\n".join(lines)

"""GPU benchmark: one device's share of a linear-attention sequence split over many
devices (`meshes.split_recurrence`) against the plain kernel on the same tokens.

    PYTHONPATH=src:. python3 experiments/bench_long_context_linear.py [--op gla kda]
        [--batch 1] [--tokens 8192] [--heads 64] [--head-dim 128] [--ranks 128]
    PYTHONPATH=src:. python3 experiments/bench_long_context_linear.py --interpret

A 1M-token sequence over 128 devices leaves each one 8192 tokens. A device's share of
the split computation is the widened kernel pass (its range's [M | L]: Dk + Dv value
channels from the state [I | 0]), log2(ranks) rounds of the scan's combine
(`meshes.split_recurrence.compose`) applied to the local result and stand-in "received"
data (one device: the `ppermute`s themselves are not timed, their payload is [Dk,
Dk + Dv] fp32 per head and round), and the output pass from the incoming state. Its
baseline is the plain kernel on the same tokens from a zero state (the Pallas kernels,
or with `--impl reference` the plain-JAX references). q, k, v bf16,
gates fp32 (`bench_linear_attention.inputs`).

Prints one JSON row per op: the kernel's value widths in the split (Dk + Dv and Dv, or
three passes where the kernel has no tile for Dk + Dv), then forward and forward+backward
(the gradients of every input, the received data's included) as alternating rounds of
the split and the plain kernel (`experiments.timing.interleaved_ratios`): `split_*_ms`,
`plain_*_ms`, and `overhead_*`, the split's time over the plain kernel's (the median of
the per-round ratios, inverted). `--interpret` runs a tiny shape on the CPU (the kernels
interpreted), one round: a check that the benchmark runs, not a measurement.
"""
import argparse
import json
import os

TINY = dict(batch=1, tokens=128, heads=2, head_dim=16, ranks=8)
FULL = dict(batch=1, tokens=8192, heads=64, head_dim=128, ranks=128)
ROUNDS = dict(rounds=15, calls=5)
# the Pallas kernels, or the plain-JAX chunked references (same contract)
IMPLS = {
    "pallas": dict(gla="chunked_gla", kda="chunked_kda"),
    "reference": dict(gla="gla_chunked", kda="kda_chunked")
}


def split_share(kernel, ranks, widths):
  """One device's share of the split computation: fn(*kernel inputs, received) -> (o,);
  `received` [B, H, Dk, Dk + Dv] fp32 stands in for each round's incoming [M | L].
  Appends the value width of each kernel pass to `widths` as it traces."""
  import jax.numpy as jnp
  from meshes.split_recurrence import compose, scan_rounds, transition_and_own_state

  def recording(q, k, v, g, *rest, **kwargs):
    out = kernel(q, k, v, g, *rest, **kwargs)
    widths.append(v.shape[-1])
    return out

  def share(q, k, v, g, *rest_and_received):
    *rest, received = rest_and_received
    dk = q.shape[-1]
    common = dict(scale=None, segment_ids=None, output_final_state=True)
    m, l = transition_and_own_state(recording, q, k, v, g, rest, common)
    rounds = scan_rounds(ranks)
    for r in range(len(rounds)):
      got_m = m if r == len(rounds) - 1 else received[..., :dk]  # the last round sends L
      m, l = compose((got_m, received[..., dk:]), (m, l))
    # l stands in for the previous device's end state, received by one more ppermute
    o, _ = recording(q, k, v, g, *rest, initial_state=l, segment_ids=None)
    return (o,)

  return share


def bench_op(op, impl, batch, tokens, heads, head_dim, ranks, gates, rounds):
  import jax
  import jax.numpy as jnp
  from experiments.bench_linear_attention import fwd_and_fwdbwd, inputs
  from experiments.timing import interleaved_ratios
  from pallas_kernels import linear_attention as la
  from meshes.split_recurrence import scan_rounds

  x = inputs(batch, tokens, heads, head_dim, gates=gates)
  if op == "kda":
    beta = jax.nn.sigmoid(jax.random.normal(jax.random.key(7), (batch, tokens, heads)))
    x = (*x, beta)
  kernel = getattr(la, IMPLS[impl][op])
  eye = jnp.broadcast_to(jnp.eye(head_dim, dtype=jnp.float32), (batch, heads, head_dim, head_dim))
  received = jnp.concatenate([0.5 * eye, jnp.ones_like(eye)], axis=-1)
  widths = []
  share = split_share(kernel, ranks, widths)
  row = {
      "op": op,
      "impl": impl,
      "shape": [batch, tokens, heads, head_dim],
      "ranks": ranks,
      "scan_rounds": len(scan_rounds(ranks)),
      "gates": gates
  }
  sides = {
      "plain": fwd_and_fwdbwd(kernel, len(x)),
      "split": fwd_and_fwdbwd(share,
                              len(x) + 1),
  }
  for i, kind in enumerate(("fwd", "fwdbwd")):
    r = interleaved_ratios({"split": lambda: sides["split"][i](*x, received)},
                           lambda: sides["plain"][i](*x), **rounds)
    if i == 0:
      row["kernel_widths"] = widths[:]  # traced by the first (forward) call
    row[f"plain_{kind}_ms"] = r["baseline_ms"]
    row[f"split_{kind}_ms"] = r["split"]["ms"]
    row[f"overhead_{kind}"] = round(1.0 / r["split"]["median"], 3)
    row[f"vs_plain_{kind}"] = r
  print(json.dumps(row), flush=True)
  return row


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--op", nargs="+", choices=("gla", "kda"), default=["kda", "gla"])
  ap.add_argument("--impl", choices=tuple(IMPLS), default="pallas")
  ap.add_argument("--interpret", action="store_true",
                  help="on the CPU, kernels interpreted, at a tiny default shape, one round")
  for name, full in FULL.items():
    ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                    help=f"default {full} ({TINY[name]} with --interpret)")
  ap.add_argument("--gates", choices=("logsigmoid", "kda_init"), default="kda_init",
                  help="gate draw (experiments/bench_linear_attention.py --gates)")
  args = ap.parse_args(argv)
  if args.interpret:
    os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX starts a backend: Pallas interprets
  shape = {
      name:
          getattr(args, name) if getattr(args, name) is not None else
          (TINY if args.interpret else FULL)[name] for name in FULL
  }
  if shape["ranks"] < 1 or shape["head_dim"] < 16:
    ap.error(f"--ranks must be >= 1 and --head-dim >= 16, got {shape}")
  import jax
  print(jax.devices(), flush=True)
  rounds = dict(rounds=1, calls=1) if args.interpret else ROUNDS
  return [bench_op(op, args.impl, **shape, gates=args.gates, rounds=rounds) for op in args.op]


if __name__ == "__main__":
  main()

"""GPU benchmark: the KDA q / k prologue in XLA, in our fused kernel and in jla's.

    PYTHONPATH=src:. python3 experiments/bench_kda_prologue.py [--shapes 1,32768,32,128 ...]

The prologue of q and of k: a short causal depthwise convolution (4 taps, documents kept
apart by segment ids), SiLU and the per-head L2 norm. The baseline is the XLA path,
`pallas_kernels.short_conv.short_conv_silu_reference(normalize=True)` (the convolution
and SiLU in one fusion, rounded to bf16, the norm in plain JAX); against it, in the same
alternating rounds, `short_conv_silu` (its default, the rows form: one Pallas pass each
way; and the blocks form's settings of FUSED) and jla's `short_conv_l2norm` (one Mosaic GPU
kernel each way). Each shape prints one JSON row: forward and forward+backward (the gradients of
x and the conv weight) milliseconds, ratios to the XLA path and fused against jla
(medians of per-round ratios, > 1: the first named is slower), and the relative RMS
difference of each output and of its gradients (dx, dw) from the XLA path's. jla missing
or failing is reported, and the row still has the rest.

The row's `gate_*` entries time the decay the same way: the XLA path computes g from the
gate projection f in one fusion (DecayGate, Kimi Linear's form), writes it in fp32 and
the in-chunk cumulative sum kernel reads it back; `decay_cumsum` computes g inside that
kernel (forward+backward: the gradients of f, a_log and dt_bias). jla computes its gate
in XLA too, so it has no side here.
"""
import argparse
import functools
import json

import jax
import jax.numpy as jnp

from experiments.bench_linear_attention import rel_rms
from experiments.timing import failed, interleaved_ratios, median_ratio, peer
from pallas_kernels.linear_attention._chunk_cumsum import chunk_cumsum, decay_cumsum
from pallas_kernels.linear_attention.decay_gate import DecayGate
from pallas_kernels.short_conv import short_conv_silu, short_conv_silu_reference

SHAPES = [(1, 32768, 32, 128), (2, 16384, 16, 128), (1, 8192, 96, 128)]
TAPS = 4
DOCUMENTS = 8  # per row, of random lengths


def inputs(B, T, H, D, seed=0):
  """(x [B, T, H, D] bf16, conv weight [H, D, TAPS] fp32, segment ids [B, T])."""
  kx, kw, ks = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (B, T, H, D), jnp.bfloat16)
  w = TAPS**-0.5 * jax.random.normal(kw, (H, D, TAPS), jnp.float32)
  starts = jax.random.randint(ks, (B, DOCUMENTS - 1), 1, T)
  segment_ids = jnp.sum(jnp.arange(T)[None, :, None] >= starts[:, None, :], axis=-1)
  return x, w, segment_ids.astype(jnp.int32)


def ours(x, w, segment_ids):
  return short_conv_silu_reference(x, w, segment_ids, normalize=True)


def fused(x, w, segment_ids, **options):
  return short_conv_silu(x, w, segment_ids, normalize=True, **options)


# short_conv_silu's options: the kernel's default (the rows form, each program streaming
# one head's rows: no shift products, no halos) and the blocks form: its defaults (the
# two-kernel backward at 16-token blocks), a forward of 64-token blocks (fewer halo reads,
# one program per SM: experiments/kernel_resources.py), the two-kernel backward at 32-token
# blocks (fewer programs, fewer halo reads) and the one-kernel backward at 32
FUSED = {
    "fused": {},
    "fused_blocks":
        dict(form="blocks"),
    "fused_blocks_fwd64":
        dict(form="blocks", block_tokens=(64, None)),
    "fused_blocks_bwd_two_kernels32":
        dict(form="blocks", backward="two_kernels", block_tokens=(None, 32)),
    "fused_blocks_bwd_one_kernel32":
        dict(form="blocks", backward="one_kernel", block_tokens=(None, 32)),
}


def jla_prologue():
  from jla.ops.mosaic_gpu.short_conv_l2norm import short_conv_l2norm

  def fn(x, w, segment_ids):
    B, T, H, D = x.shape
    y = short_conv_l2norm(x.reshape(B, T, H * D), w.reshape(H * D, TAPS), head_dim=D,
                          segment_ids=segment_ids)
    return y.reshape(B, T, H, D)

  return fn


def fwd_and_fwdbwd(fn):
  """Jitted forward and forward+backward: the loss, a random projection of the output, and
    the gradients of x and w (both, as in bench_linear_attention.fwd_and_fwdbwd)."""

  def loss(x, w, segment_ids):
    y = fn(x, w, segment_ids).astype(jnp.float32)
    return jnp.sum(y * jax.random.normal(jax.random.key(1), y.shape))

  return jax.jit(fn), jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def gate_inputs(B, T, H, D, seed=1):
  """(f [B, T, H, D] bf16, a_log [H], dt_bias [H, D]): the released initialisation."""
  kf, kp = jax.random.split(jax.random.key(seed))
  gate = DecayGate.drawn(kp, H, D)
  return jax.random.normal(kf, (B, T, H, D), jnp.bfloat16), gate.a_log, gate.dt_bias


def gate_xla(f, a_log, dt_bias):
  return chunk_cumsum(DecayGate(a_log, dt_bias)(f))


def gate_fused(f, a_log, dt_bias):
  return decay_cumsum(f, DecayGate(a_log, dt_bias), f.shape[1])


def gate_fwd_and_fwdbwd(fn):
  """Jitted forward and forward+backward (a random projection of b; the gradients of f,
    a_log and dt_bias)."""

  def loss(*a):
    b = fn(*a)
    return jnp.sum(b * jax.random.normal(jax.random.key(2), b.shape))

  return jax.jit(fn), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def bench_gate(shape, rounds=15, calls=10):
  """The decay gate and its in-chunk sum: `decay_cumsum` against the XLA path."""
  x, row = gate_inputs(*shape), {}
  xla, fused = gate_fwd_and_fwdbwd(gate_xla), gate_fwd_and_fwdbwd(gate_fused)
  try:
    ref = xla[0](*x)
    row["gate_rel_rms_fused_vs_xla"] = rel_rms(ref, fused[0](*x))
    jax.block_until_ready(fused[1](*x))
  except Exception as e:
    return {"gate_fused": failed(e)}
  for i, kind in enumerate(("fwd", "fwdbwd")):
    r = interleaved_ratios({"fused": lambda: fused[i](*x)}, lambda: xla[i](*x), rounds=rounds,
                           calls=calls)
    row[f"gate_xla_{kind}_ms"], row[f"gate_fused_{kind}_ms"] = r["baseline_ms"], r["fused"]["ms"]
    row[f"gate_fused_vs_xla_{kind}"] = r["fused"]["median"]
  return row


def bench_shape(shape, rounds=15, calls=10):
  """One shape: the fused kernel and jla's against the XLA path, in the same rounds."""
  x = inputs(*shape)
  row = {"shape": list(shape), "taps": TAPS, "documents_per_row": DOCUMENTS}
  sides = {
      name: fwd_and_fwdbwd(functools.partial(fused, **options)) for name, options in FUSED.items()
  }
  theirs, missing = peer(jla_prologue)
  if missing:
    row["jla"] = missing
  else:
    sides["jla"] = fwd_and_fwdbwd(theirs)
  xla = fwd_and_fwdbwd(ours)
  ref, (_, ref_grads) = xla[0](*x), xla[1](*x)
  for name, fns in list(sides.items()):
    try:
      row[f"rel_rms_{name}_vs_xla"] = rel_rms(ref, fns[0](*x))
      _, (dx, dw) = fns[1](*x)
      row[f"rel_rms_{name}_dx_vs_xla"] = rel_rms(ref_grads[0], dx)
      row[f"rel_rms_{name}_dw_vs_xla"] = rel_rms(ref_grads[1], dw)
    except Exception as e:  # a failing side does not hide the others' figures
      row[name] = failed(e)
      del sides[name]
  for i, kind in enumerate(("fwd", "fwdbwd")):
    r = interleaved_ratios({
        name: lambda f=fns[i]: f(*x) for name, fns in sides.items()
    }, lambda: xla[i](*x), rounds=rounds, calls=calls)
    row[f"xla_{kind}_ms"] = r["baseline_ms"]
    for name in sides:
      row[f"{name}_{kind}_ms"] = r[name]["ms"]
      row[f"{name}_vs_xla_{kind}"] = r[name]["median"]
    if "jla" in sides:
      for name in set(FUSED) & set(sides):
        row[f"{name}_vs_jla_{kind}"] = median_ratio(r, "jla", name)
  return row


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shapes", nargs="*", type=lambda s: tuple(map(int, s.split(","))),
                  default=SHAPES, help="B,T,H,D")
  args = ap.parse_args()
  print(jax.devices(), flush=True)
  for shape in args.shapes:
    print(json.dumps(bench_shape(shape) | bench_gate(shape)), flush=True)


if __name__ == "__main__":
  main()

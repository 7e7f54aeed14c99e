"""GPU benchmark: the KDA q / k prologue as the model runs it against jla's fused kernel.

    PYTHONPATH=src:. python3 experiments/bench_kda_prologue.py [--shapes 1,32768,32,128 ...]

The prologue of q and of k: a short causal depthwise convolution (4 taps, documents kept
apart by segment ids), SiLU and the per-head L2 norm. Ours is what the KDA layer and
`chunked_kda(normalize_qk=True)` run: `hylora.model.short_conv.causal_depthwise_conv`,
SiLU and a bf16 round in XLA, then the L2 norm in plain JAX (autodiff), back to bf16.
jla's `short_conv_l2norm` does all of it in one Mosaic GPU kernel, forward and backward.
Each shape prints one JSON row: forward and forward+backward (gradients of x and the conv
weight) milliseconds of both in alternating rounds (`experiments.timing.
interleaved_ratios`, ratio = jla / ours: > 1, ours faster) and the two outputs' relative
RMS difference. jla missing or failing is reported, and the row still has ours.
"""
import argparse
import json

import jax
import jax.numpy as jnp

from experiments.timing import failed, interleaved_ratios, median_ms, peer
from hylora.model.short_conv import causal_depthwise_conv
from pallas_kernels.linear_attention._inputs import l2_normalize

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
  y = jax.nn.silu(causal_depthwise_conv(x, w, segment_ids)).astype(x.dtype)
  return l2_normalize(y).astype(x.dtype)


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


def bench_shape(shape, rounds=15, calls=10):
  x = inputs(*shape)
  row = {"shape": list(shape), "taps": TAPS, "documents_per_row": DOCUMENTS}
  mine = fwd_and_fwdbwd(ours)
  row["ours_fwd_ms"] = round(median_ms(mine[0], *x), 3)
  row["ours_fwdbwd_ms"] = round(median_ms(mine[1], *x), 3)
  theirs, missing = peer(jla_prologue)
  if missing:
    row["jla"] = missing
    return row
  try:
    theirs = fwd_and_fwdbwd(theirs)
    ref = mine[0](*x).astype(jnp.float32)
    diff = ref - theirs[0](*x).astype(jnp.float32)
    row["rel_rms_vs_jla"] = float(jnp.sqrt(jnp.mean(diff**2) / jnp.mean(ref**2)))
    for i, kind in enumerate(("fwd", "fwdbwd")):
      r = interleaved_ratios({"ours": lambda i=i: mine[i](*x)}, lambda i=i: theirs[i](*x),
                             rounds=rounds, calls=calls)
      row[f"jla_{kind}_ms"] = r["baseline_ms"]
      row[f"vs_jla_{kind}"] = r["ours"]
  except Exception as e:  # a failing peer does not hide our figures
    row["jla"] = failed(e)
  return row


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shapes", nargs="*", type=lambda s: tuple(map(int, s.split(","))),
                  default=SHAPES, help="B,T,H,D")
  args = ap.parse_args()
  print(jax.devices(), flush=True)
  for shape in args.shapes:
    print(json.dumps(bench_shape(shape)), flush=True)


if __name__ == "__main__":
  main()

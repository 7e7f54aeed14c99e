"""GPU benchmark: Pallas chunked GLA (or KDA) vs the plain-JAX chunked reference and the
peers, all in the same process.

    PYTHONPATH=src:. python3 experiments/bench_linear_attention.py [--peers jla,fla]
    PYTHONPATH=src:. python3 experiments/bench_linear_attention.py --op kda [--shapes 1,8192,64,128] [--breakdown]

Prints a correctness check of each setting against the fp32 reference in each gate
regime (at CORRECTNESS_SHAPE; `--skip-correctness`: not, for a timing run whose settings an
earlier run checked), then per shape forward and
forward+backward milliseconds of each Pallas setting (`experiments.timing.median_ms`;
forward+backward as training runs it: the output, which the loss reads, and every
input's gradient, see `fwd_and_fwdbwd`),
and every comparison as alternating rounds of ours and the other side in this process
(`experiments.timing.interleaved_ratios`): the plain-JAX reference (`reference_*_ms`,
`vs_reference_*`) and the peers, jla's Mosaic GPU kernels (`linear_attention(...,
impl="mosaic_gpu")`) and fla's `chunk_gla` / `chunk_kda` (PyTorch, on the same arrays),
at every shape (`jla_*_ms`, `vs_jla_*`, ...), each shape in every gate regime (`--gates`);
for KDA every side L2-normalises q and k, as chunked_kda does by default.
A peer that is not installed is reported as missing; one that fails at a shape, as failed.
"""
import argparse
import functools
import importlib.util
import inspect
import itertools
import json
import os

import jax
import jax.numpy as jnp

from experiments.timing import failed, interleaved_ratios, median_ms, peer, to_torch
from pallas_kernels.linear_attention import chunked_gla, gla_chunked
from pallas_kernels.linear_attention._chunk_factors import (KEY_GRAD_KERNELS, SCORE_KERNELS,
                                                            SCORE_OPERANDS)
from pallas_kernels.linear_attention.gla import Tiling
from pallas_kernels.linear_attention._kda_solve import INVERSES
from pallas_kernels.linear_attention.kda import DECAY_SUMS, INVERSE_PRODUCTS, QK_NORMS, SOLVES
from pallas_kernels.linear_attention._pallas_common import SUMMED_ROWS

SHAPES = [(1, 32768, 32, 128), (2, 16384, 16, 128), (1, 8192, 96, 128), (1, 1048576, 8, 128)]
REFERENCE_SKIP = {
    (1, 1048576, 8, 128): "reference skipped: its fwd+bwd alone would take seconds per call"
}

# log_sigmoid(N(0, 1)) (about -0.8 a token), log_sigmoid(N(-3, 1)) (about -3 a token: every
# chunk decays past the whole-chunk limit), and the KDA layer's formula at initialisation.
GATES = ("logsigmoid", "logsigmoid_strong", "kda_init")
STATE_WALKS = ("auto", "triton", "mosaic")


def kda_init_gates(key, B, T, H, D):
  """Gates as fla's KDA layer draws them at initialisation: g = -A softplus(x + dt_bias),
    A ~ U(1, 16) per head, dt = softplus(dt_bias) log-uniform in [1e-3, 0.1] per channel,
    x a small projection (0.1 N(0, 1)): down to about -1.6 to -2.5 per token, so heads with a
    large A hold channels that decay by more than a sub-chunk's anchor allows
    (2 * FACTOR_LIMIT), within one anchor per chunk (2 * WHOLE_LIMIT)."""
  from pallas_kernels.linear_attention.decay_gate import DecayGate
  kp, kx = jax.random.split(key)
  return DecayGate.drawn(kp, H, D)(0.1 * jax.random.normal(kx, (B, T, H, D), jnp.float32))


def layout_shares(g):
  """The share of (chunk, head) blocks in each in-chunk layout (_chunk_factors) over all of
    a head's channels, as the key gradients take them (a kernel that decides per key block
    may take a faster layout) and as the scores do ("scores_" names)."""
  from pallas_kernels.linear_attention import _chunk_factors as factors
  from pallas_kernels.linear_attention._inputs import CHUNK
  T = g.shape[1] // CHUNK * CHUNK
  names = {
      factors.WHOLE_CHUNK: "whole_chunk",
      factors.PER_SUB_CHUNK: "per_sub_chunk",
      factors.HALVES: "halves",
      factors.SUB_CHUNKS: "sub_chunks"
  }

  def shares(layouts, prefix, codes):
    return {prefix + names[c]: round(float(jnp.mean(layouts == c)), 3) for c in codes}

  return (shares(factors.chunk_layouts(g[:, :T]), "",
                 (factors.WHOLE_CHUNK, factors.PER_SUB_CHUNK, factors.SUB_CHUNKS)) |
          shares(factors.score_layouts(g[:, :T]), "scores_",
                 (factors.WHOLE_CHUNK, factors.HALVES, factors.SUB_CHUNKS)))


def inputs(B, T, H, D, seed=0, gates="logsigmoid"):
  ks = jax.random.split(jax.random.key(seed), 4)
  q, k, v = (jax.random.normal(kk, (B, T, H, D), jnp.bfloat16) for kk in ks[:3])
  if gates == "kda_init":
    return q, k, v, kda_init_gates(ks[3], B, T, H, D)
  mean = -3.0 if gates == "logsigmoid_strong" else 0.0
  g = jax.nn.log_sigmoid(mean + jax.random.normal(ks[3], (B, T, H, D), jnp.float32))
  return q, k, v, g


def kda_inputs(shape, seed=0, gates="logsigmoid"):
  """inputs() of a (B, T, H, D) shape and the KDA write strengths beta [B, T, H]."""
  beta = jax.nn.sigmoid(jax.random.normal(jax.random.key(seed + 7), shape[:3], jnp.float32))
  return (*inputs(*shape, seed=seed, gates=gates), beta)


def inputs_at(shape, seed=0, gates="logsigmoid"):
  """inputs() of a (B, T, H, D) shape."""
  return inputs(*shape, seed=seed, gates=gates)


# The correctness check's shape: small enough for the fp32 reference's gradients, long
# enough for every layout to occur in the strong and KDA-initialisation regimes.
CORRECTNESS_SHAPE = (1, 4096, 4, 128)


def fwd_and_fwdbwd(fn, inputs=4):
  """Jitted forward (the output) and forward+backward: the loss, a sum of the output, and
    the gradients of every input, as a training step needs both. With the gradients alone
    XLA drops any kernel whose only result is the output (ours: the outputs kernel of the
    split forward), while a kernel that writes the output beside the backward's residuals
    (jla's state-and-output kernel) still runs: the two sides would not do the same work."""
  fwd = jax.jit(lambda *a: fn(*a)[0])
  loss = lambda *a: fn(*a)[0].astype(jnp.float32).sum()
  fwdbwd = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(inputs))))
  return fwd, fwdbwd


PEERS = ("jla", "fla")
# Alternating rounds: the reference is ~10x slower than ours (fewer calls a round).
ROUNDS = {"reference": dict(rounds=5, calls=2), "peer": dict(rounds=15, calls=10)}


def peer_fns(name, op, x):
  """A peer's (forward, forward+backward) on the inputs x, as functions of no arguments
    (forward+backward: the gradients of every input, as ours), or "missing: ..." where the
    peer is not installed."""

  # KDA: the peers L2-normalise q and k as chunked_kda does by default (and the released
  # layer does); their own defaults skip it
  normalized = op == "kda"

  def jla():
    from jla.ops import linear_attention as la
    gates = ("g",) if op == "gla" else ("g", "beta")
    options = dict(use_qk_l2norm=True) if normalized else {}
    fwd, fwdbwd = fwd_and_fwdbwd(
        lambda q, k, v, *gs: la(op, q, k, v, impl="mosaic_gpu", **dict(zip(gates, gs)), **options),
        len(x))
    return (lambda: fwd(*x)), (lambda: fwdbwd(*x))

  def fla():
    import torch
    if op == "gla":
      from fla.ops.gla import chunk_gla as fn
    else:
      from fla.ops.kda import chunk_kda as fn
    t = [to_torch(a, requires_grad=True) for a in x]
    options = dict(use_qk_l2norm_in_kernel=True) if normalized else {}

    def fwd():
      with torch.no_grad():
        return fn(*t, **options)[0]

    return fwd, (lambda: torch.autograd.grad(fn(*t, **options)[0].float().sum(), t))

  made, missing = peer({"jla": jla, "fla": fla}[name])
  return made if made else missing


def compare(row, ours, sides, x):
  """Every one of ours ({name: (fwd, fwdbwd)}, jitted, called on x) against each side
    ({name: (fwd, fwdbwd) of no arguments, or why it did not run}), forward and
    forward+backward, in alternating rounds: row[f"{side}_{pass}_ms"] and
    row[f"vs_{side}_{pass}"] (per candidate: baseline / candidate time, > 1: ours faster)."""
  for side, fns in sides.items():
    if isinstance(fns, str):
      row[side] = fns
      continue
    for i, kind in enumerate(("fwd", "fwdbwd")):
      try:
        r = interleaved_ratios({
            name: (lambda f=f[i]: f(*x)) for name, f in ours.items()
        }, fns[i], **ROUNDS["reference" if side == "reference" else "peer"])
        row[f"{side}_{kind}_ms"] = round(r["baseline_ms"], 3)
        row[f"vs_{side}_{kind}"] = r
      except Exception as e:  # a peer that fails at this shape does not hide the rest
        row[f"{side}_{kind}"] = failed(e)


def parse_peers(value):
  """--peers: a comma list of PEERS, or none."""
  peers = [p for p in value.split(",") if p and p != "none"]
  unknown = [p for p in peers if p not in PEERS]
  if unknown:
    raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {PEERS} or none")
  return peers


def rel_rms(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.sqrt(jnp.mean((a - b)**2) / jnp.mean(a**2)))


def correctness(op, impls, reference, make_inputs, gates, shape=CORRECTNESS_SHAPE):
  """Each setting's output and gradients against the fp32 plain-JAX chunked version, in
    each gate regime (strong gates take other in-chunk layouts than mild ones): one JSON
    line per regime and setting. make_inputs(shape, seed, gates) -> the op's inputs, the
    first three q, k, v (the reference takes those in fp32). Each regime's first row is the
    floor: the reference itself on the inputs as given (setting "reference[bf16]" for bf16
    inputs), what rounding them and its output to that dtype costs (gradients through the
    loss's sin(o) grow with |o|)."""
  loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)[0].astype(jnp.float32)))
  for regime in gates:
    x = make_inputs(shape, seed=1, gates=regime)
    n = len(x)
    f32 = [a.astype(jnp.float32) for a in x[:3]] + list(x[3:])
    o_ref = jax.jit(lambda *a: reference(*a)[0])(*f32)
    g_ref = jax.jit(jax.grad(loss(reference), tuple(range(n))))(*f32)
    names = ("q", "k", "v", "g", "beta")[:n]
    floor = (f"reference[{jnp.dtype(x[0].dtype).name}]", reference)
    for name, kernel in [floor, *impls]:
      try:
        o = jax.jit(lambda *a, kernel=kernel: kernel(*a)[0])(*x)
        g_pal = jax.jit(jax.grad(loss(kernel), tuple(range(n))))(*x)
        errs = {
            "o": rel_rms(o_ref, o)
        } | {
            f"d{v}": rel_rms(a, b) for v, a, b in zip(names, g_ref, g_pal)
        }
      except Exception as e:  # a setting that fails here is timed (and fails) on its own below
        errs = failed(e)
      print(
          json.dumps({
              "correctness_vs_fp32_reference": list(shape),
              "op": op,
              "gates": regime,
              "setting": name,
              "rel_rms": errs
          }), flush=True)


# Settings that choose between kernels the breakdown times side by side anyway.
BREAKDOWN_TIMES_EVERY = ("forward", "decayed_rows", "scores", "key_grads")


def breakdown_tilings(tilings):
  """The distinct breakdowns among --tiling's settings: those differing only in
    BREAKDOWN_TIMES_EVERY time the same kernels."""
  defaults = Tiling()
  kept = {
      t._replace(**{f: getattr(defaults, f) for f in BREAKDOWN_TIMES_EVERY}):
          None for _, t in tilings
  }
  return list(kept)


def kernel_breakdown(shape, tiling, gates="logsigmoid"):
  """Milliseconds of each kernel (and the plain-JAX preparation) alone; on Hopper (or
    interpreted) also the fused forward's two kernels."""
  from pallas_kernels.linear_attention import _chunk_prep
  from pallas_kernels.linear_attention._gla_chunks import (chunk_key_grads, chunk_outputs,
                                                           chunk_value_grads)
  from pallas_kernels.linear_attention._gla_forward_mosaic import gla_forward
  from pallas_kernels.linear_attention._gla_scores import chunk_score_grads, chunk_scores
  from pallas_kernels.linear_attention._mosaic_common import forward_value_tile, on_hopper
  from pallas_kernels.linear_attention._pallas_common import interpret_mode
  from pallas_kernels.linear_attention.gla import state_walk_kind, state_walks
  interp = interpret_mode()  # a CPU smoke run interprets the kernels
  B, T, H, D = shape
  q, k, v, g = inputs(*shape, gates=gates)
  t = tiling._replace(interpret=interp)
  t = t._replace(state_walk=state_walk_kind(t, (q.dtype, k.dtype, v.dtype), D, D))
  chunk_states, chunk_state_grads = state_walks(t)
  prep = jax.jit(lambda q, k, v, g: _chunk_prep.prepare(q, k, v, g, None, B, T))
  qp, kp, vp, b, runs = prep(q, k, v, g)
  gp = _chunk_prep.prepare(q, k, v, g, None, B, T, summed=False)[3]  # the decays unsummed
  ci, il = _chunk_prep.segment_masks(runs)
  h0 = jnp.zeros((B, H, D, D), jnp.float32)
  scale = D**-0.5
  ck = dict(interpret=interp, num_warps=t.chunk_warps)
  gk = dict(interpret=interp, num_warps=t.grad_warps)
  states = jax.jit(lambda k, v, b: chunk_states(k, v, b, il, ci, h0))
  h, _ = states(kp, vp, b)
  dstates = jax.jit(lambda q, b, do: chunk_state_grads(q, b, ci, do, h0, scale=scale))
  ds, _ = dstates(qp, b, vp)
  sk = dict(interpret=interp, num_warps=t.score_warps, num_stages=t.score_stages)
  scores = jax.jit(lambda q, k, b: chunk_scores(q, k, b, runs, **sk))
  scores_by_layout = jax.jit(lambda q, k, b: chunk_scores(q, k, b, runs, form="by_layout", **sk))
  scores_summing = jax.jit(lambda q, k, g: chunk_scores(q, k, g, runs, from_gates=True, **sk))
  a = scores(qp, kp, b)
  outputs = jax.jit(
      lambda q, v, b, h, a: chunk_outputs(q, v, b, ci, h, a, scale=scale, block_v=t.block_v, **ck))
  dscores = jax.jit(lambda v, do: chunk_score_grads(v, runs, do, scale=scale, **gk))
  da, dat = dscores(vp, vp)
  value_grads = jax.jit(lambda k, b, ds, do: chunk_value_grads(
      k, b, il, ds, a, do, scale=scale, block_v=min(t.grad_block_v, D), **gk))

  def key_grads_with(**setting):
    key_kw = dict(scale=scale, block_k=t.block_k, num_stages=t.grad_stages, **gk, **setting)
    return jax.jit(lambda q, k, v, b, h, ds, do: chunk_key_grads(q, k, v, b, ci, il, h, ds, do, da,
                                                                 dat, **key_kw))

  key_grads, key_grads_by_layout = key_grads_with(), key_grads_with(by_layout=True)
  kernel_ms = {
      # b and the run ids alone: a jitted function returning its (unpadded) inputs may copy them
      "prepare": round(median_ms(jax.jit(lambda *a: prep(*a)[3:]), q, k, v, g), 3),
      "states": round(median_ms(states, kp, vp, b), 3),
      "scores": round(median_ms(scores, qp, kp, b), 3),
      "scores_by_layout": round(median_ms(scores_by_layout, qp, kp, b), 3),
      "scores_summing_decays": round(median_ms(scores_summing, qp, kp, gp), 3),
      "outputs": round(median_ms(outputs, qp, vp, b, h, a), 3),
      "state_grads": round(median_ms(dstates, qp, b, vp), 3),
      "score_grads": round(median_ms(dscores, vp, vp), 3),
      "value_grads": round(median_ms(value_grads, kp, b, ds, vp), 3),
      "key_grads": round(median_ms(key_grads, qp, kp, vp, b, h, ds, vp), 3),
      "key_grads_by_layout": round(median_ms(key_grads_by_layout, qp, kp, vp, b, h, ds, vp), 3)
  }
  if interp or on_hopper():  # the fused forward's two kernels (Tiling.forward="fused")
    decayed = jax.jit(lambda q, k, b: chunk_scores(q, k, b, runs, decayed_with=(ci, il), **sk))
    fused = jax.jit(
        lambda qg, kg, v, a, b: gla_forward(qg, kg, v, a, b, ci, h0, scale=scale, interpret=interp,
                                            block_v=forward_value_tile(t.forward_block_v, B, H, D)))
    summing = {
        rows:
            jax.jit(lambda q, k, g, rows=rows: chunk_scores(q, k, g, runs, decayed_with=(
                ci, il), from_gates=True, summed_rows=rows, **sk)) for rows in SUMMED_ROWS
    }
    try:
      a_d, qg, kg = decayed(qp, kp, b)
      kernel_ms["fused.scores_with_decayed_rows"] = round(median_ms(decayed, qp, kp, b), 3)
      for rows, fn in summing.items():  # the forward's own: the decays summed there too
        kernel_ms[f"fused.scores_summing_{rows}_with_decayed_rows"] = round(
            median_ms(fn, qp, kp, gp), 3)
      xla_rows = jax.jit(lambda q, k, b: _chunk_prep.decayed_rows(q, k, b, ci, il, q.dtype))
      kernel_ms["fused.decayed_rows_xla"] = round(median_ms(xla_rows, qp, kp, b), 3)
      kernel_ms["fused.state_outputs"] = round(median_ms(fused, qg, kg, vp, a_d, b), 3)
    except Exception as e:  # reported, so that the other figures still print
      kernel_ms["fused"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
  return {"shape": list(shape), "gates": gates, "state_walk": t.state_walk, "kernel_ms": kernel_ms}


def kda_kernel_breakdown(shape, gates="logsigmoid"):
  """Milliseconds of each KDA kernel alone (forward: intra = scores + solve, states,
    output; backward adds the recomputed intra with the inverse, dv_local, state_grads,
    wy_grads, key_grads); the state kernels in every implementation that runs here, and
    where Mosaic GPU runs the fused forward's kernel (states and outputs)."""
  from pallas_kernels.linear_attention import _chunk_prep
  from pallas_kernels.linear_attention._kda_intra import SOLVE_WARPS, chunk_intra
  from pallas_kernels.linear_attention._kda_scores import chunk_scores
  from pallas_kernels.linear_attention._kda_key_grads import chunk_key_grads
  from pallas_kernels.linear_attention.kda import available_state_walks
  from pallas_kernels.linear_attention._kda_value_side import (chunk_dv_local, chunk_output,
                                                               chunk_wy_grads)
  from pallas_kernels.linear_attention._pallas_common import interpret_mode
  interp = interpret_mode()  # a CPU smoke run interprets the kernels
  B, T, H, D = shape
  q, k, v, g = inputs(*shape, gates=gates)
  beta = jax.nn.sigmoid(jax.random.normal(jax.random.key(7), shape[:3], jnp.float32))
  qp, kp, vp, b, runs = _chunk_prep.prepare(q, k, v, g, None, B, T)
  gp = _chunk_prep.prepare(q, k, v, g, None, B, T, summed=False)[3]  # the decays unsummed
  beta = jnp.pad(beta, ((0, 0), (0, qp.shape[1] - T), (0, 0)))
  ci, il = _chunk_prep.segment_masks(runs)
  h0 = jnp.zeros((B, H, D, D), jnp.float32)
  cd, scale = jnp.bfloat16, D**-0.5
  kw = dict(block_v=min(D, 64 if D <= 128 else 32), cd=cd, interpret=interp)
  intra = jax.jit(
      lambda *a, e, warps=SOLVE_WARPS: chunk_intra(*a, runs, ci, il, cd=cd, emit_inverse=e,
                                                   interpret=interp, solve_warps=warps),
      static_argnames=("e", "warps"))
  qg, kg, w, u0, aqk, inv = intra(qp, kp, vp, b, beta, e=True)
  intra_by_layout = jax.jit(
      lambda *a, solve, inverse="by_halves":
      chunk_intra(*a, runs, ci, il, cd=cd, emit_inverse=False, interpret=interp, scores="by_layout",
                  solve=solve, inverse=inverse), static_argnames=("solve", "inverse"))

  def scores_with(**setting):
    return jax.jit(lambda *a: chunk_scores(*a, runs, ci, il, cd=cd, interpret=interp, **setting))

  scores = scores_with()
  scores_by_layout = scores_with(form="by_layout")
  scores_normalizing = scores_with(form="by_layout", normalize=True)
  scores_summing = scores_with(form="by_layout", normalize=True, keep_normalized=False,
                               from_gates=True)
  walks = available_state_walks(interp)
  chunk_states, chunk_state_grads = walks["triton"]
  states = jax.jit(lambda w, u0, kg, b: chunk_states(w, u0, kg, b, ci, h0, **kw))
  h, vn, _ = states(w, u0, kg, b)
  output = jax.jit(
      lambda qg, aqk, h, vn: chunk_output(qg, aqk, h, vn, scale=scale, out_dtype=vp.dtype, **kw))
  dv_local = jax.jit(lambda aqk, do, vn: chunk_dv_local(aqk, do, vn, runs, scale=scale, **kw))
  dvl, dp = dv_local(aqk, vp, vn)
  dstates = jax.jit(lambda qg, kg, w, b, dvl, do: chunk_state_grads(qg, kg, w, b, ci, dvl, do, h0,
                                                                    scale=scale, **kw))
  dh, dvn, _ = dstates(qg, kg, w, b, dvl, vp)
  wy = jax.jit(lambda inv, dvn, vn, v, beta: chunk_wy_grads(inv, dvn, vn, v, beta, runs, **kw))
  _, dx, da, _ = wy(inv, dvn, vn, vp, beta)

  def key_with(**setting):
    return jax.jit(lambda q, k, b, beta, h, dh, do, vn, dx, dp, da: chunk_key_grads(
        q, k, b, beta, ci, il, h, dh, do, vn, dx, dp, da, scale=scale, block_k=min(D, 64),
        **(kw | setting)))

  key = key_with()  # by layout, chunked_kda's default
  key_8_warps = key_with(num_warps=8)
  key_one_kernel = key_with(form="one_kernel")
  key_other_chunks_8_warps = key_with(other_warps=8)
  walk_ms = {}
  if "mosaic" in walks:  # the fused forward: walk and outputs, states written for the backward
    from pallas_kernels.linear_attention._kda_forward_mosaic import kda_forward
    from pallas_kernels.linear_attention._mosaic_common import forward_value_tile
    tile = forward_value_tile(KDA_DEFAULTS["forward_block_v"], B, H, D)
    launch = dict(block_v=tile, scale=scale, out_dtype=vp.dtype, interpret=interp, with_states=True)
    fused = jax.jit(lambda *rows: kda_forward(*rows, ci, h0, **launch))
    walk_ms["fused_states_outputs"] = round(median_ms(fused, w, u0, kg, qg, aqk, b), 3)
  for name, (walk_states, walk_grads) in walks.items():
    walk_ms[f"states_{name}"] = round(
        median_ms(jax.jit(lambda w, u0, kg, b: walk_states(w, u0, kg, b, ci, h0, **kw)), w, u0, kg,
                  b), 3)
    walk_ms[f"state_grads_{name}"] = round(
        median_ms(
            jax.jit(lambda qg, kg, w, b, dvl, do: walk_grads(
                qg, kg, w, b, ci, dvl, do, h0, scale=scale, **kw)), qg, kg, w, b, dvl, vp), 3)
  return {
      "op":
          "kda",
      "shape":
          list(shape),
      "gates":
          gates,
      "kernel_ms":
          walk_ms | {
              "intra":
                  round(median_ms(lambda *a: intra(*a, e=False), qp, kp, vp, b, beta), 3),
              "intra_with_inverse":
                  round(median_ms(lambda *a: intra(*a, e=True), qp, kp, vp, b, beta), 3),
              "intra_with_inverse_solve_8_warps":
                  round(median_ms(lambda *a: intra(*a, e=True, warps=8), qp, kp, vp, b, beta), 3),
              "intra_by_layout_solve_in_scores":
                  round(
                      median_ms(lambda *a: intra_by_layout(*a, solve="in_scores"), qp, kp, vp, b,
                                beta), 3),
              "intra_by_layout_solve_own_kernel":
                  round(
                      median_ms(lambda *a: intra_by_layout(*a, solve="own_kernel"), qp, kp, vp, b,
                                beta), 3),
              "intra_by_layout_inverse_whole_chunk":
                  round(
                      median_ms(
                          lambda *a: intra_by_layout(*a, solve="own_kernel", inverse="whole_chunk"),
                          qp, kp, vp, b, beta), 3),
              "of_which_scores":
                  round(median_ms(scores, qp, kp, b, beta), 3),
              "scores_normalizing_q_k":
                  round(median_ms(scores_normalizing, qp, kp, b, beta), 3),
              "scores_by_layout":
                  round(median_ms(scores_by_layout, qp, kp, b, beta), 3),
              "scores_normalizing_summing_decays":
                  round(median_ms(scores_summing, qp, kp, gp, beta), 3),
              "output":
                  round(median_ms(output, qg, aqk, h, vn), 3),
              "dv_local":
                  round(median_ms(dv_local, aqk, vp, vn), 3),
              "wy_grads":
                  round(median_ms(wy, inv, dvn, vn, vp, beta), 3),
              "key_grads":
                  round(median_ms(key, qp, kp, b, beta, h, dh, vp, vn, dx, dp, da), 3),
              "key_grads_8_warps":
                  round(median_ms(key_8_warps, qp, kp, b, beta, h, dh, vp, vn, dx, dp, da), 3),
              "key_grads_other_chunks_8_warps":
                  round(
                      median_ms(key_other_chunks_8_warps, qp, kp, b, beta, h, dh, vp, vn, dx, dp,
                                da), 3),
              "key_grads_in_one_kernel":
                  round(median_ms(key_one_kernel, qp, kp, b, beta, h, dh, vp, vn, dx, dp, da), 3),
          }
  }


def bench_shape(row, op, impls, reference, x, shape, skip_reference, peers):
  """One shape: each of ours (impls: [(name, fn)]) timed on its own, then compared with
    the plain-JAX reference and the peers in alternating rounds (`compare`)."""
  ours = {}
  for name, fn in impls:
    fwd, fwdbwd = fwd_and_fwdbwd(fn, len(x))
    try:
      row[f"{name}_fwd_ms"] = round(median_ms(fwd, *x), 3)
      row[f"{name}_fwdbwd_ms"] = round(median_ms(fwdbwd, *x), 3)
      ours[name] = (fwd, fwdbwd)
    except Exception as e:  # one setting that fails does not hide the others
      row[name] = failed(e)
  sides = {}
  if skip_reference:
    pass
  elif shape in REFERENCE_SKIP:
    sides["reference"] = REFERENCE_SKIP[shape]
  else:
    fwd, fwdbwd = fwd_and_fwdbwd(reference, len(x))
    sides["reference"] = (lambda: fwd(*x)), (lambda: fwdbwd(*x))
  if peers:
    for name in peers:
      try:
        sides[name] = peer_fns(name, op, x)
      except Exception as e:
        sides[name] = failed(e)
  if ours:
    compare(row, ours, sides, x)
  else:  # nothing of ours to compare: only say why a side did not run
    row.update({side: why for side, why in sides.items() if isinstance(why, str)})
  print(json.dumps(row), flush=True)


def default_kda_forwards():
  """The forward chunked_kda takes by default here: the fused one where Mosaic GPU runs."""
  from pallas_kernels.linear_attention._mosaic_common import on_hopper
  return ["fused"] if on_hopper() else ["split"]


# chunked_kda's kernel choices the benchmark varies, each with its choices and the
# command-line flag that names them
KDA_CHOICES = {
    "scores": (SCORE_KERNELS, "--kda-scores"),
    "key_grads": (KEY_GRAD_KERNELS, "--kda-key-grads"),
    "qk_norm": (QK_NORMS, "--kda-qk-norms"),
    "solve": (SOLVES, "--kda-solves"),
    "decay_sum": (DECAY_SUMS, "--kda-decay-sums"),
    "score_operands": (SCORE_OPERANDS, "--kda-score-operands"),
    "inverse": (INVERSES, "--kda-inverses"),
    "summed_rows": (SUMMED_ROWS, "--kda-summed-rows"),
    "block_v": ((16, 32, 64, 128), "--kda-block-v"),
    "forward_block_v": ((32, 64, 128, "by_heads"), "--kda-forward-block-v"),
    "inverse_products": (("auto",) + INVERSE_PRODUCTS, "--kda-inverse-products"),
}


def _int_or_name(value):
  """A command-line choice that is a width or a name."""
  return int(value) if value.isdigit() else value


def _kda_defaults():
  """chunked_kda's own value of each of KDA_CHOICES."""
  from pallas_kernels.linear_attention import chunked_kda
  params = inspect.signature(chunked_kda).parameters
  return {name: params[name].default for name in KDA_CHOICES}


KDA_DEFAULTS = _kda_defaults()


def kda_settings(walks, forwards, **choices):
  """[(name, chunked_kda with those settings)]: every combination of the values asked for
    (choices: name of KDA_CHOICES -> values; the default where not given), the op's
    defaults unnamed."""
  from pallas_kernels.linear_attention import chunked_kda
  impls = []
  values = [choices.get(name) or (KDA_DEFAULTS[name],) for name in KDA_CHOICES]
  for combination in itertools.product(*values):
    kernels = dict(zip(KDA_CHOICES, combination))
    named = "".join(
        f",{name}={value}" for name, value in kernels.items() if value != KDA_DEFAULTS[name])
    impls += [(f"pallas[state_walk={walk}{named}]",
               functools.partial(chunked_kda, state_walk=walk, forward="split", **kernels))
              for walk in walks
              if "split" in forwards]
    if "fused" in forwards:  # its backward's walk: "auto"
      impls.append((f"pallas[forward=fused{named}]",
                    functools.partial(chunked_kda, forward="fused", **kernels)))
  return impls


def bench_kda(shapes, skip_reference, breakdown=False, gates=("logsigmoid",), peers=(),
              walks=STATE_WALKS, forwards=("split",), correctness_shape=CORRECTNESS_SHAPE,
              **choices):
  """`--op kda`: Pallas chunked_kda vs the plain-JAX kda_chunked and the peers, fwd and
    fwd+bwd; first each setting's correctness at correctness_shape (None: none). choices:
    as kda_settings takes them."""
  from pallas_kernels.linear_attention import kda_chunked

  impls = kda_settings(walks, forwards, **choices)
  if correctness_shape:
    correctness("kda", impls, kda_chunked, kda_inputs, gates, correctness_shape)
  for shape, regime in itertools.product(shapes, gates):
    x = kda_inputs(shape, gates=regime)
    row = {"op": "kda", "shape": list(shape), "gates": regime, "layouts": layout_shares(x[3])}
    bench_shape(row, "kda", impls, kda_chunked, x, shape, skip_reference, peers)
    del x
  if breakdown:  # after the comparisons: a run cut short keeps those
    for regime in gates:
      print(json.dumps(kda_kernel_breakdown(shapes[0], regime)), flush=True)


def parse_tiling(spec):
  """"block_k=64,state_walk=triton" -> ("[block_k=64,state_walk=triton]", Tiling(...));
    "" -> defaults."""
  fields = dict(kv.split("=") for kv in spec.split(",") if kv)
  return (f"[{spec}]" if spec else ""), Tiling(**{
      k: int(v) if v.isdigit() else v for k, v in fields.items()
  })


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument(
      "--peers", metavar="PEERS", type=parse_peers, default=list(PEERS),
      help=f"peers to compare in this process, of {','.join(PEERS)} (default: "
      "all; those not installed are reported as missing), or none.")
  ap.add_argument("--tiling", nargs="*", default=[parse_tiling("")], type=parse_tiling,
                  help="launch settings to compare, e.g. block_k=64,block_v=32,state_stages=3")
  ap.add_argument("--shapes", nargs="*", type=lambda s: tuple(map(int, s.split(","))),
                  default=SHAPES, help="B,T,H,D")
  ap.add_argument("--skip-reference", action="store_true")
  ap.add_argument(
      "--skip-correctness", action="store_true",
      help="no correctness rows: the timed shapes only (their settings checked by an earlier run)")
  ap.add_argument("--breakdown", action="store_true", help="also time each kernel alone")
  ap.add_argument("--op", choices=("gla", "kda"), default="gla")
  ap.add_argument(
      "--gates", nargs="+", choices=GATES, default=list(GATES),
      help="how the timed shapes' gates are drawn (each shape in every regime given): "
      "log_sigmoid of N(0, 1) or of N(-3, 1), or as fla's KDA layer initialises them")
  ap.add_argument("--state-walks", nargs="+", choices=STATE_WALKS, default=list(STATE_WALKS),
                  help="--op kda: the state walks to time (auto: mosaic where it runs)")
  helps = {
      "scores": "the in-chunk scores' kernels: one kernel branching per chunk (one_kernel) "
                "or one per layout (by_layout)",
      "key_grads": "the key gradients' kernels: one kernel branching per chunk (one_kernel) "
                   "or the whole-chunk-anchored chunks' and then the others' (by_layout)",
      "qk_norm": "where the L2 norm of q and k runs: as a plain-JAX pass before the kernels "
                 "(xla) or inside the first scores kernel (kernel, with --kda-scores "
                 "by_layout)",
      "solve": "where the in-chunk solve runs: in the scores' kernels (in_scores, with "
               "--kda-scores by_layout) or in a kernel of its own (own_kernel)",
      "decay_sum": "where the in-chunk cumulative decay is summed: in a kernel of its own "
                   "(own_kernel) or in the first scores kernel (in_scores, with --kda-scores "
                   "by_layout)",
      "score_operands": "the operand dtype of the factored in-chunk score products: fp32 "
                        "(TF32) or the compute dtype (compute)",
      "inverse": "how the solve's own kernel forms the in-chunk inverse: by doubling over "
                 "the whole chunk (whole_chunk) or each half on its own, joined (by_halves)",
      "summed_rows": "with --kda-decay-sums in_scores, the rows of the summed decays the "
                     "first scores kernel writes in the fused forward alone: every row (all) "
                     "or the chunks' last rows and the rows the later kernels read "
                     "(chunk_ends)",
      "block_v": "value channels per program of every kernel but the fused forward "
                 "(--kda-forward-block-v)",
      "forward_block_v": "value channels per program of the fused forward (B H Dv / width "
                         "programs): a width, or by_heads (by the batch rows x heads)",
      "inverse_products":
          "where the fused forward alone forms T's products w = T kw and "
          "u0 = T beta v: the solve's kernel (in_solve) or the walk (in_walk, "
          "the solve writing T alone), or auto (in_walk where the tile is the whole head)",
  }
  for name, (known, flag) in KDA_CHOICES.items():
    ap.add_argument(flag, nargs="+", choices=known, default=[KDA_DEFAULTS[name]], type=_int_or_name,
                    help=f"--op kda: {helps[name]}; default: the op's own")
  ap.add_argument(
      "--kda-forwards", nargs="+", choices=("split", "fused"), default=None,
      help="--op kda: the forwards to time: split (with each of --state-walks) "
      "and fused (walk and outputs in one Mosaic GPU kernel, Hopper); by default the "
      "op's own: fused on Hopper, else split")
  args = ap.parse_args()
  if "fla" in args.peers and importlib.util.find_spec("fla"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch shares the GPU
  print(jax.devices(), flush=True)
  if args.op == "kda":
    return bench_kda(
        args.shapes, args.skip_reference, args.breakdown, args.gates, args.peers, args.state_walks,
        args.kda_forwards or default_kda_forwards(),
        None if args.skip_correctness else CORRECTNESS_SHAPE, **{
            name: getattr(args, flag[2:].replace("-", "_"))
            for name, (_, flag) in KDA_CHOICES.items()
        })
  gla_impls = [(f"pallas{name}", functools.partial(chunked_gla, tiling=tiling))
               for name, tiling in args.tiling]
  if not args.skip_correctness:
    correctness("gla", gla_impls, gla_chunked, inputs_at, args.gates)
  for shape, regime in itertools.product(args.shapes, args.gates):
    x = inputs(*shape, gates=regime)
    row = {"op": "gla", "shape": list(shape), "gates": regime, "layouts": layout_shares(x[3])}
    bench_shape(row, "gla", gla_impls, gla_chunked, x, shape, args.skip_reference, args.peers)
    del x
  if args.breakdown:  # after the comparisons: a run cut short keeps those
    for tiling, regime in itertools.product(breakdown_tilings(args.tiling), args.gates):
      print(json.dumps(kernel_breakdown(args.shapes[0], tiling, regime)), flush=True)


if __name__ == "__main__":
  main()

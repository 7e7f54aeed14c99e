"""GPU benchmark: the KDA forward stage by stage, ours and jla's, in one process.

    PYTHONPATH=src:. python3 -m experiments.linear_attention_forward_stages \
        [--shape 1,32768,32,128] [--gates logsigmoid logsigmoid_strong]

Each stage alone (`experiments.timing.median_ms`: one call at a time, so every figure
carries a launch and a wait; compare stages, not sums), then the whole forward of each side.
Ours: the L2 norm of q and k (plain JAX), the in-chunk cumulative decay, the in-chunk scores
in each form (one kernel; one kernel per layout, chunked_kda's default, and the same
normalising q and k on its way, as chunked_kda does without gradients), scores and solve
together (the scores in one kernel, then the solve; by layout, then the solve; by layout,
the HALVES chunks solved in the scores' kernel), the fused state walk and outputs (the value
tile by heads, chunked_kda's default, and 64 wide), the forward (chunked_kda's defaults;
with the norm as a plain-JAX pass; with the decays summed in the first scores kernel; with
the fused forward's value tile 64 wide). jla (when installed): its cumulative decay, its in-chunk
kernel with the L2 norm inside and the decayed rows out (the forward's path when no
gradient is asked), without the norm, without the rows, its solve and its state walk that
applies T itself. One JSON line per gate regime.
"""
import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

from experiments.bench_linear_attention import inputs
from experiments.timing import failed, median_ms
from pallas_kernels.linear_attention import _chunk_prep, chunked_kda
from pallas_kernels.linear_attention._chunk_cumsum import chunk_cumsum
from pallas_kernels.linear_attention._inputs import l2_normalize
from pallas_kernels.linear_attention._kda_intra import chunk_intra
from pallas_kernels.linear_attention._kda_scores import chunk_scores
from pallas_kernels.linear_attention._mosaic_common import forward_value_tile
from pallas_kernels.linear_attention._pallas_common import interpret_mode


def ours(q, k, v, g, beta):
  """{stage: ms} of chunked_kda's forward."""
  B, T, H, D = q.shape
  interp, cd = interpret_mode(), jnp.bfloat16
  norm = jax.jit(lambda q, k: (l2_normalize(q).astype(q.dtype), l2_normalize(k).astype(k.dtype)))
  ms = {"normalize": median_ms(norm, q, k)}
  qp, kp, vp, b, runs = _chunk_prep.prepare(*norm(q, k), v, g, None, B, T)
  ci, il = _chunk_prep.segment_masks(runs)
  ms["cumsum"] = median_ms(jax.jit(chunk_cumsum), g)
  for name, form in (("scores", "one_kernel"), ("scores_by_layout", "by_layout")):
    scores = jax.jit(lambda q, k, b, beta, form=form: chunk_scores(q, k, b, beta, runs, ci, il, cd=
                                                                   cd, interpret=interp, form=form))
    ms[name] = median_ms(scores, qp, kp, b, beta)
  raw = _chunk_prep.prepare(q, k, v, g, None, B, T)[:2]
  normalizing = jax.jit(
      lambda q, k, b, beta: chunk_scores(q, k, b, beta, runs, ci, il, cd=cd, interpret=interp, form=
                                         "by_layout", normalize=True, keep_normalized=False))
  ms["scores_by_layout_normalizing"] = median_ms(normalizing, *raw, b, beta)
  for name, form, solve in (("scores_and_solve", "one_kernel", "own_kernel"),
                            ("scores_by_layout_then_solve", "by_layout",
                             "own_kernel"), ("scores_by_layout_solving", "by_layout", "in_scores")):
    intra = jax.jit(lambda q, k, v, b, beta, form=form, solve=solve: chunk_intra(
        q, k, v, b, beta, runs, ci, il, cd=cd, emit_inverse=False, interpret=interp, scores=form,
        solve=solve))
    ms[name] = median_ms(intra, qp, kp, vp, b, beta)
  qg, kg, w, u0, aqk = intra(qp, kp, vp, b, beta)
  if not interp:
    from pallas_kernels.linear_attention._kda_forward_mosaic import kda_forward
    h0 = jnp.zeros((B, H, D, v.shape[-1]), jnp.float32)
    by_heads = forward_value_tile("by_heads", B, H, v.shape[-1])  # chunked_kda's default
    launch = dict(scale=D**-0.5, out_dtype=v.dtype, interpret=False)
    for name, width in (("walk_and_outputs", by_heads), ("walk_and_outputs_64", 64)):
      walk = jax.jit(lambda w, u0, kg, qg, aqk, b, width=width: kda_forward(
          w, u0, kg, qg, aqk, b, ci, h0, block_v=width, **launch))
      ms[name] = median_ms(walk, w, u0, kg, qg, aqk, b)
  for name, options in (("forward", {}), ("forward_qk_norm_xla", dict(qk_norm="xla")),
                        ("forward_decay_sum_in_scores", dict(decay_sum="in_scores")),
                        ("forward_value_tile_64", dict(forward_block_v=64))):
    ms[name] = median_ms(jax.jit(lambda *a, options=options: chunked_kda(*a, **options)[0]), q, k,
                         v, g, beta)
  return ms


def jla(q, k, v, g, beta):
  """{stage: ms} of jla's Mosaic GPU KDA forward without gradients, as it runs it."""
  from jla.ops import linear_attention
  from jla.ops.mosaic_gpu import vector_gate as vg
  from jla.ops.mosaic_gpu.vector_gate_ops import _forward_state_config
  B, T, H, D = q.shape
  cfg = vg.Config(batch=B, seq_len=T, heads=H, key_dim=D, value_dim=v.shape[-1], scale=D**-0.5,
                  channel_gates=False, l2norm=True)
  plain = dataclasses.replace(cfg, l2norm=False)
  ms = {"cumsum": median_ms(jax.jit(lambda g: vg.chunk_cumsum(cfg, g, None)), g)}
  g_cum, marks, g_last, bounded = vg.chunk_cumsum(cfg, g, None)
  beta_heads = jnp.swapaxes(beta, 1, 2)
  state = (g_cum, marks, beta_heads, bounded)

  def intra(c, **kw):
    return jax.jit(lambda q, k, g_cum, marks, e, ok: vg.intra(c, q, k, g_cum, marks, e, ok, **kw))

  aqk, akk, qg, neg_kd, kg = intra(cfg, decays=True)(q, k, *state)
  ms["intra_l2norm_decays"] = median_ms(intra(cfg, decays=True), q, k, *state)
  ms["intra_decays"] = median_ms(intra(plain, decays=True), q, k, *state)
  ms["intra"] = median_ms(intra(plain), q, k, *state)
  solve = jax.jit(lambda a: vg.solve(cfg, a))
  t = solve(akk)
  ms["solve"] = median_ms(solve, akk)
  walk_cfg = _forward_state_config(cfg, fused=True)
  walk = jax.jit(lambda kg, kd, v, g_last, qg, aqk, t, e: vg.state_output(
      walk_cfg, kg, kd, v, g_last, None, qg, aqk, pieces=None, save=False, t=t, write=e))
  ms["walk_and_outputs"] = median_ms(walk, kg, neg_kd, v, g_last, qg, aqk, t, beta_heads)
  ms["forward"] = median_ms(
      jax.jit(lambda q, k, v, g, beta: linear_attention("kda", q, k, v, impl="mosaic_gpu", g=g, beta
                                                        =beta, use_qk_l2norm=True)[0]), q, k, v, g,
      beta)
  return ms


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--shape", type=lambda s: tuple(map(int, s.split(","))),
                  default=(1, 32768, 32, 128))
  ap.add_argument("--gates", nargs="+", default=["logsigmoid", "logsigmoid_strong"])
  args = ap.parse_args()
  for gates in args.gates:
    q, k, v, g = inputs(*args.shape, gates=gates)
    beta = jax.nn.sigmoid(jax.random.normal(jax.random.key(7), args.shape[:3], jnp.float32))
    row = {"shape": list(args.shape), "gates": gates}
    for name, stages in (("ours", ours), ("jla", jla)):
      try:
        row[name] = {s: round(t, 3) for s, t in stages(q, k, v, g, beta).items()}
      except Exception as e:  # a peer that is missing or fails does not hide ours
        row[name] = failed(e)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()

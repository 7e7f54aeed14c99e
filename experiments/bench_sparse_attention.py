"""GPU benchmark of top-K sparse attention: Pallas kernels vs the plain-JAX reference.

    PYTHONPATH=src:. python3 experiments/bench_sparse_attention.py --seqs 32768,131072

First checks the kernels against the reference at a small size (relative errors of
the output and of dq/dk/dv for both dk/dv methods and for masked dense attention, top-K
set overlap for every selection), then times, per sequence length:
- indexer + top-K with each selection (the per-row kernel, the default; by threshold
  under XLA; sorting) and the score kernel with 1 and 4 queries per program;
- the selection alone on one chunk of causal scores: by threshold under XLA with 1, 2
  and 4 bits per counting pass, by the per-row kernel per --select-tiles setting, and
  sorting;
- attention forward, and a sweep of its tile settings (--fwd-tiles);
- forward + backward with the key-major dk/dv pass and with atomics (one backward pass
  per range of KEYS_PER_RANGE keys, of 8192 keys, and one pass over all keys);
- the backward kernel alone, dq only and with its dk/dv atomics per --bwd-tiles
  setting (by key ranges as the custom VJP runs it);
- the sort that splits the selection into key ranges, the key sort and the key-major
  pass alone;
- masked dense attention (cuDNN under the selection mask, the other choice of
  by_density.py) and dense cuDNN causal attention over every key (the bar to beat),
  forward and forward + backward;
- the reference's forward + backward at the first length (--reference);
with each compiled function's temporary memory (each figure by
`experiments.timing.median_ms`). Then the comparisons, each in alternating rounds of ours
and the other side in this process (`experiments.timing.interleaved_ratios`): the Pallas
forward and forward + backward against dense cuDNN causal attention and against jla's
naive gather (`jla.ops.dsa_gather.gather_attention`, reported as missing where jla is not
installed), and with --reference the forward + backward against the reference (COMPARISONS).
Prints one JSON object per measurement; --only keeps and --skip leaves out measurements
and comparisons by name, --budget-s stops starting new lengths past it.
"""
import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp

from experiments.timing import failed, interleaved_ratios, median_ms, peer
from pallas_kernels.sparse_attention import (sparse_attention, sparse_attention_reference,
                                             topk_indices, topk_indices_reference)
from pallas_kernels.sparse_attention.attention_backward_by_key import (pairs_by_key,
                                                                       sparse_attention_dkdv)
from pallas_kernels.sparse_attention.attention_backward import sparse_attention_backward
from pallas_kernels.sparse_attention.attention_forward import sparse_attention_forward
from pallas_kernels.sparse_attention.by_density import prefers_dense
from pallas_kernels.sparse_attention.indexer_topk import CHUNK_SCORE_BYTES
from pallas_kernels.sparse_attention.kernel_setup import use_interpret
from pallas_kernels.sparse_attention.key_ranges import KEYS_PER_RANGE, n_ranges, split_by_range
from pallas_kernels.sparse_attention.masked_dense import masked_dense_attention
from pallas_kernels.sparse_attention.sparse_attention_vjp import group_heads, kernel_layout
from pallas_kernels.sparse_attention.threshold_top_k import BITS_PER_PASS, threshold_top_k
from pallas_kernels.sparse_attention.top_k_kernel import kernel_top_k

_START = time.perf_counter()


def compiled_with_temp(fn, *args):
  """jit(fn) compiled for args, and its temporary memory in GB (None where unknown)."""
  compiled = jax.jit(fn).lower(*args).compile()
  mem = compiled.memory_analysis()
  return compiled, None if mem is None else round(mem.temp_size_in_bytes / 1e9, 3)


# (name, ours, the other side): measurement names of `bench`, or of the peer's functions
COMPARISONS = (
    ("pallas_fwd_vs_dense_cudnn_causal", "pallas_fwd", "dense_cudnn_causal_fwd"),
    ("pallas_fwdbwd_vs_dense_cudnn_causal", "pallas_fwdbwd_atomic", "dense_cudnn_causal_fwdbwd"),
    ("pallas_fwd_vs_jla_gather", "pallas_fwd", "jla_gather_fwd"),
    ("pallas_fwdbwd_vs_jla_gather", "pallas_fwdbwd_atomic", "jla_gather_fwdbwd"),
    ("pallas_fwdbwd_vs_reference", "pallas_fwdbwd_atomic", "reference_fwdbwd"),
)


def jla_gather(idx):
  """jla's naive gather attention (the peer), forward and forward + backward on the
    same selection, or "missing: ..." where jla is not installed."""

  def make():
    from jla.ops.dsa_gather import gather_attention
    return {
        "jla_gather_fwd": lambda q, k, v: gather_attention(q, k, v, idx),
        "jla_gather_fwdbwd": jax.grad(loss_of(gather_attention, idx), (0, 1, 2))
    }

  made, missing = peer(make)
  return made or missing


def random_indices(key, b, t, k):
  """As the peers comparison does: K random causal keys per query (repeats possible), -1 past t."""
  pos = jnp.arange(t)[:, None]
  r = jax.random.randint(key, (t, k), 0, t)
  idx = jnp.where(jnp.arange(k)[None, :] < jnp.minimum(pos + 1, k), r % (pos + 1), -1)
  return jnp.broadcast_to(idx[None], (b, t, k)).astype(jnp.int32)


def distinct_indices(key, b, t, k):
  """K distinct causal keys per query (a random permutation prefix), -1 past t."""
  perm = jax.vmap(lambda kk: jax.random.permutation(kk, t))(jax.random.split(key, t))[:, :k]
  idx = jnp.where(perm <= jnp.arange(t)[:, None], perm, -1)
  return jnp.broadcast_to(idx[None], (b, t, k)).astype(jnp.int32)


def inputs(key, b, t, hq, hk, d):
  ks = jax.random.split(key, 4)
  q = jax.random.normal(ks[0], (b, t, hq, d), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, t, hk, d), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, t, hk, d), jnp.bfloat16)
  return q, k, v, ks[3]


def rel(a, b):
  a, b = a.astype(jnp.float32).ravel(), b.astype(jnp.float32).ravel()
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def loss_of(attn, idx, **kw):
  return lambda q, k, v: attn(q, k, v, idx, **kw).astype(jnp.float32).sum()


def forward_with(q, k, v, idx, block_k, num_warps, num_stages):
  """The forward kernel with explicit tile settings (for the sweep)."""
  qg, kh, vh, ip, block_k = kernel_layout(q, k, v, idx, *([block_k] if block_k else []))
  return sparse_attention_forward(qg, kh, vh, ip, scale=q.shape[3]**-0.5, block_k=block_k,
                                  interpret=use_interpret(), num_warps=num_warps,
                                  num_stages=num_stages)


def dense_causal(q, k, v):
  """Dense causal attention over every key: cuDNN's fused kernel on the GPU."""
  impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)


def backward_pass(q, k, v, idx, do, block_k, num_warps, num_stages, atomic_dkdv=True):
  """The query-major backward kernel alone, from the forward's real lse, one pass per
    key range as the custom VJP runs it (atomic dk/dv); without atomic_dkdv it computes
    dq only, which splits the backward's time into the gathers + matmuls and the dk/dv
    atomics."""
  d, hk = q.shape[3], k.shape[2]
  o, lse = forward_with(q, k, v, idx, None, 4, 2)
  ranges = None
  if atomic_dkdv and n_ranges(k.shape[1], KEYS_PER_RANGE) > 1:
    idx, *ranges = split_by_range(idx, k.shape[1], KEYS_PER_RANGE)
  qg, kh, vh, ip, block_k = kernel_layout(q, k, v, idx, block_k)  # <= the padded K
  dog = group_heads(do, hk)
  delta = jnp.sum(o.astype(jnp.float32) * dog.astype(jnp.float32), -1)

  def run(qg, kh, vh, ip, dog, lse, delta, ranges):
    return sparse_attention_backward(qg, kh, vh, ip, dog, lse, delta, scale=d**-0.5,
                                     block_k=block_k, interpret=use_interpret(),
                                     atomic_dkdv=atomic_dkdv, ranges=ranges, num_warps=num_warps,
                                     num_stages=num_stages)

  return run, (qg, kh, vh, ip, dog, lse, delta, ranges)


def dkdv_pass(q, k, v, idx, do, rows, num_warps):
  """The key-major dk/dv pass alone (sort included), with the forward's real lse."""
  b, t, hq, _ = q.shape
  hk = k.shape[2]
  o, lse = forward_with(q, k, v, idx, None, 4, 2)
  o = o[:, :, :, :hq // hk].reshape(q.shape)
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), -1)
  lse = lse[..., :hq // hk].reshape(b, t, hq)

  def run(q, k, v, do, lse, delta):
    queries, starts = pairs_by_key(idx)
    return sparse_attention_dkdv(q, k, v, do, lse, delta, queries, starts, scale=q.shape[3]**-0.5,
                                 interpret=use_interpret(), rows=rows, num_warps=num_warps)

  return run, (q, k, v, do, lse, delta)


def check(t=1024, k_sel=256, heads=(64, 8), d=128):
  q, k, v, key = inputs(jax.random.key(0), 1, t, *heads, d)
  idx = distinct_indices(key, 1, t, k_sel)
  out = {"check": "attention", "T": t, "K": k_sel}
  o = jax.jit(sparse_attention)(q, k, v, idx)
  out["fwd_rel"] = rel(o, sparse_attention_reference(q, k, v, idx))
  gr = jax.jit(jax.grad(loss_of(sparse_attention_reference, idx), (0, 1, 2)))(q, k, v)
  out["masked_dense_fwd_rel"] = rel(
      jax.jit(masked_dense_attention)(q, k, v, idx), sparse_attention_reference(q, k, v, idx))
  methods = {
      "by_key": functools.partial(sparse_attention, dkdv="by_key"),
      "atomic": functools.partial(sparse_attention, dkdv="atomic"),
      "atomic_4_ranges": functools.partial(sparse_attention, dkdv="atomic", keys_per_range=t // 4),
      "masked_dense": masked_dense_attention
  }
  for method, attn in methods.items():
    try:
      g = jax.jit(jax.grad(loss_of(attn, idx), (0, 1, 2)))(q, k, v)
      out.update({f"{method}_d{n}_rel": rel(a, b) for n, a, b in zip("qkv", g, gr)})
    except Exception as e:  # report, keep going
      out[method] = f"failed: {type(e).__name__}: {str(e)[:600]}"
  print(json.dumps(out), flush=True)
  ks = jax.random.split(key, 3)
  qi = jax.random.normal(ks[0], (1, t, 64, 128), jnp.bfloat16)
  ki = jax.random.normal(ks[1], (1, t, 128), jnp.bfloat16)
  w = jax.random.normal(ks[2], (1, t, 64), jnp.float32)
  r = topk_indices_reference(qi, ki, w, top_k=k_sel)
  for selection in ("sort", "threshold", "kernel"):
    a = jax.jit(lambda *x: topk_indices(*x, top_k=k_sel, selection=selection))(qi, ki, w)
    same = jax.vmap(lambda x, y: jnp.isin(x, y).mean())(a[0], r[0])
    print(
        json.dumps({
            "check": f"indexer ({selection})",
            "T": t,
            "K": k_sel,
            "set_overlap": float(same.mean()),
            "exact_rows": float((same == 1).mean())
        }), flush=True)


INDEXER_TILES = "2x4,4x8"
SELECT_TILES = "4x512x4,4x1024x8,4x2048x8,2x512x4,4x256x4"
FWD_TILES = "128x4x2,64x8x2,128x8x3,32x4x3,64x4x3,64x4x4,64x2x3,32x2x3"
BWD_TILES = "64x4x2,32x4x3,64x4x3,32x2x3,32x2x4,16x2x3,32x1x3,64x2x3"


def parse_tiles(spec):
  """"64x4x2,32x2x3" -> ((64, 4, 2), (32, 2, 3)): keys per step x warps x stages (for
    the selection kernel: bits per pass x block x warps; for the indexer's score kernel:
    queries per program x warps)."""
  return tuple(tuple(map(int, tile.split("x"))) for tile in spec.split(",") if tile)


def bench(t, k_sel=2048, with_reference=False, skip=(), only=(), fwd_tiles=parse_tiles(FWD_TILES),
          bwd_tiles=parse_tiles(BWD_TILES), select_tiles=parse_tiles(SELECT_TILES),
          indexer_tiles=parse_tiles(INDEXER_TILES)):
  q, k, v, key = inputs(jax.random.key(1), 1, t, 64, 8, 128)
  idx = random_indices(key, 1, t, k_sel)
  ks = jax.random.split(key, 3)
  qi = jax.random.normal(ks[0], (1, t, 64, 128), jnp.bfloat16)
  ki = jax.random.normal(ks[1], (1, t, 128), jnp.bfloat16)
  w = jax.random.normal(ks[2], (1, t, 64), jnp.float32)
  res = {"T": t, "K": k_sel, "HQ": 64, "HK": 8, "D": 128}
  do = jax.random.normal(ks[0], q.shape, q.dtype)
  runs = [
      ("indexer_topk", lambda a, b, c: topk_indices(a, b, c, top_k=k_sel), (qi, ki, w)),
      # the score kernel's tiling: queries per program (each key block loaded once
      # for all of them) and warps
      *[(f"indexer_topk_q{q}_w{nw}" + (f"_bk{bk[0]}" if bk else ""), lambda a, b, c, q=q, nw=nw, bk=
         bk: topk_indices(a, b, c, top_k=k_sel, queries_per_program=q, num_warps=nw,
                          **({
                              "block_k": bk[0]
                          } if bk else {})), (qi, ki, w)) for q, nw, *bk in indexer_tiles],
      # float8 indexer inputs (as DeepSeek-V3.2 runs its indexer): the score
      # kernel's matmuls at the FP8 rate
      ("indexer_topk_fp8", lambda a, b, c: topk_indices(a, b, c, top_k=k_sel),
       (qi.astype(jnp.float8_e4m3fn), ki.astype(jnp.float8_e4m3fn), w)),
      *[(f"indexer_topk_{sel}",
         lambda a, b, c, sel=sel: topk_indices(a, b, c, top_k=k_sel, selection=sel), (qi, ki, w))
        for sel in ("threshold", "sort")],
      ("pallas_fwd", lambda a, b, c: sparse_attention(a, b, c, idx), (q, k, v)),
      ("pallas_fwdbwd_by_key", jax.grad(loss_of(sparse_attention, idx, dkdv="by_key"),
                                        (0, 1, 2)), (q, k, v)),
      ("pallas_fwdbwd_atomic", jax.grad(loss_of(sparse_attention, idx, dkdv="atomic"),
                                        (0, 1, 2)), (q, k, v)),
      ("pallas_fwdbwd_atomic_one_pass",
       jax.grad(loss_of(sparse_attention, idx, keys_per_range=t), (0, 1, 2)), (q, k, v)),
      ("pallas_fwdbwd_atomic_8k_ranges",
       jax.grad(loss_of(sparse_attention, idx, keys_per_range=8192), (0, 1, 2)), (q, k, v)),
      ("split_by_range", lambda i: split_by_range(i, t, KEYS_PER_RANGE), (idx,)),
      ("pairs_by_key", lambda i: pairs_by_key(i), (idx,)),
      # the selection as an argument (a traced value, as in the model), not a
      # constant that XLA would try to fold into the mask
      ("masked_dense_fwd", masked_dense_attention, (q, k, v, idx)),
      ("dense_cudnn_causal_fwd", dense_causal, (q, k, v)),
      ("dense_cudnn_causal_fwdbwd",
       jax.grad(lambda q, k, v: dense_causal(q, k, v).astype(jnp.float32).sum(),
                (0, 1, 2)), (q, k, v)),
      ("masked_dense_fwdbwd",
       jax.grad(lambda q, k, v, i: loss_of(masked_dense_attention, i)(q, k, v),
                (0, 1, 2)), (q, k, v, idx))
  ]
  res["by_density_picks"] = ("masked_dense"
                             if prefers_dense(q.shape, k.shape, k_sel, q.dtype) else "pallas")
  # the selection alone, on one query chunk of scores as topk_indices makes them
  # (causal: -inf past the diagonal), per digit width of the threshold search
  chunk = min(t, CHUNK_SCORE_BYTES // (4 * t))
  pos = jnp.arange(t - chunk, t)[:, None] >= jnp.arange(t)[None, :]
  scores = jnp.where(pos, jax.random.normal(ks[1], (chunk, t), jnp.float32), -jnp.inf)[None]
  runs += [(f"select_threshold_{bits}bit", lambda s, bits=bits: threshold_top_k(s, k_sel, bits),
            (scores,)) for bits in BITS_PER_PASS]
  runs.append(("select_sort", lambda s: jax.lax.top_k(s, k_sel)[1], (scores,)))
  lengths = jnp.arange(t - chunk, t, dtype=jnp.int32)[None] + 1  # each query's causal keys
  for bits, block, warps in select_tiles:
    runs.append(
        (f"select_kernel_{bits}bit_b{block}_w{warps}",
         lambda s, n, bits=bits, block=block, warps=warps: kernel_top_k(
             s, k_sel, n, bits_per_pass=bits, block=block, num_warps=warps), (scores, lengths)))
  for rows, warps in ((64, 4), (128, 8), (32, 4)):
    name = f"dkdv_rows{rows}_w{warps}"
    if name not in skip and (not only or name in only):
      runs.append((f"dkdv_rows{rows}_w{warps}", *dkdv_pass(q, k, v, idx, do, rows, warps)))
  for bk, warps, stages in fwd_tiles:
    runs.append((f"fwd_bk{bk}_w{warps}_s{stages}", lambda a, b, c, bk=bk, warps=warps, stages=
                 stages: forward_with(a, b, c, idx, bk, warps, stages), (q, k, v)))
  # the backward kernel alone: dq only, then with the dk/dv atomics per tile setting
  bk, warps, stages = bwd_tiles[0]
  name = f"bwd_dq_only_bk{bk}_w{warps}_s{stages}"
  if name not in skip and (not only or name in only):
    runs.append((name, *backward_pass(q, k, v, idx, do, bk, warps, stages, atomic_dkdv=False)))
  for bk, warps, stages in bwd_tiles:
    name = f"bwd_atomic_bk{bk}_w{warps}_s{stages}"
    if name not in skip and (not only or name in only):
      runs.append((name, *backward_pass(q, k, v, idx, do, bk, warps, stages)))
  if with_reference:
    runs.append(("reference_fwdbwd", jax.grad(loss_of(sparse_attention_reference, idx),
                                              (0, 1, 2)), (q, k, v)))
  for name, fn, args in runs:
    if name in skip or (only and name not in only):
      continue
    try:
      compiled, gb = compiled_with_temp(fn, *args)
      ms = median_ms(compiled, *args, reps=3 if "reference" in name or t > 65536 else 5)
      res[f"{name}_ms"], res[f"{name}_temp_GB"] = round(ms, 3), gb
    except Exception as e:  # report, keep going
      res[f"{name}_ms"] = failed(e)
    print(json.dumps(res), flush=True)
  fns = {name: (fn, args) for name, fn, args in runs}
  peers = jla_gather(idx)
  for name, ours, other in COMPARISONS:
    if name in skip or (only and name not in only) or (other == "reference_fwdbwd" and
                                                       not with_reference):
      continue
    if other.startswith("jla_") and isinstance(peers, str):
      res[name] = peers  # "missing: ..."
    else:
      theirs = (peers[other], fns[ours][1]) if other.startswith("jla_") else fns[other]
      try:
        mine, theirs = [(jax.jit(f), a) for f, a in (fns[ours], theirs)]
        res[name] = interleaved_ratios(
            {ours: lambda: mine[0](*mine[1])}, lambda: theirs[0](*theirs[1]),
            rounds=3 if other.startswith("reference") or t > 65536 else 5, calls=1)
      except Exception as e:  # report, keep going
        res[name] = failed(e)
    print(json.dumps(res), flush=True)
  stats = jax.devices()[0].memory_stats() or {}
  res["peak_bytes_in_use_GB"] = round(stats.get("peak_bytes_in_use", 0) / 1e9, 3)
  print(json.dumps(res), flush=True)


if __name__ == "__main__":
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--seqs", default="32768,131072")
  p.add_argument("--skip-check", action="store_true")
  p.add_argument("--skip", default="", help="comma-separated measurement names to leave out")
  p.add_argument("--only", default="", help="comma-separated measurement names to run "
                 "(default: all)")
  p.add_argument("--fwd-tiles", default=FWD_TILES, help="forward tile settings to time, "
                 "keys per step x warps x stages")
  p.add_argument("--bwd-tiles", default=BWD_TILES, help="backward tile settings to time")
  p.add_argument(
      "--indexer-tiles", default=INDEXER_TILES, help="indexer score kernel "
      "settings to time beside the default, queries per program x warps "
      "[x keys per step]")
  p.add_argument("--select-tiles", default=SELECT_TILES, help="top-K kernel settings to "
                 "time, bits per pass x block x warps")
  p.add_argument("--skip-long", default="", help="also left out past the first length")
  p.add_argument("--reference", action="store_true", help="time the reference at the first length")
  p.add_argument("--top-k", type=int, default=2048)
  p.add_argument("--budget-s", type=float, default=1e9)
  a = p.parse_args()
  print(json.dumps({"device": str(jax.devices()[0]), "jax": jax.__version__}), flush=True)
  if not a.skip_check:
    check()
  for i, t in enumerate(map(int, a.seqs.split(","))):
    if time.perf_counter() - _START > a.budget_s:
      print(json.dumps({"T": t, "skipped": "out of time budget"}), flush=True)
      continue
    skip = set(filter(None, a.skip.split(",")))
    if i > 0:
      skip |= set(filter(None, a.skip_long.split(",")))
    only = set(filter(None, a.only.split(",")))
    bench(t, a.top_k, with_reference=a.reference and i == 0, skip=skip, only=only,
          fwd_tiles=parse_tiles(a.fwd_tiles), bwd_tiles=parse_tiles(a.bwd_tiles),
          select_tiles=parse_tiles(a.select_tiles), indexer_tiles=parse_tiles(a.indexer_tiles))

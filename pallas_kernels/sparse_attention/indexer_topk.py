"""Lightning-indexer scores (Pallas kernel) and per-query top-K selection.

The kernel fuses, for a few consecutive queries and a block of keys, the indexer matmul
over all their indexer heads ([queries * HI, DI] x [DI, block_k]), the ReLU, the
per-head weighting and each query's sum over its heads, plus the causal and segment
masks. Queries are processed in chunks: the
kernel writes the fp32 scores of one chunk ([chunk, T], never [T, T]) and the top-K are
selected from them (ties: smaller index first) before the next chunk: by a Pallas
program per query that reads only the query's causal keys (top_k_kernel.py), by
threshold under XLA (threshold_top_k.py) or by jax.lax.top_k.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sparse_attention import input_checks
from pallas_kernels.sparse_attention.kernel_setup import (check_head_dim, pad_axis, tile_rows,
                                                          use_interpret)
from pallas_kernels.sparse_attention.threshold_top_k import threshold_top_k
from pallas_kernels.sparse_attention.top_k_kernel import kernel_top_k

_BLOCK_K = 128
CHUNK_SCORE_BYTES = 1 << 30  # fp32 scores of one query chunk: at most 1 GiB


def _score_kernel(start_ref, q_ref, w_ref, seg_q_ref, k_ref, seg_k_ref, out_ref, *, block_k, heads,
                  fill_future):
  """Scores of the program's queries (each `heads` rows of q_ref: its padded indexer
    heads) against every key block up to the last query's; the later blocks are set to
    -inf if fill_future (a selection that reads whole rows), else left unwritten."""
  n_queries = out_ref.shape[0]
  first = start_ref[0] + pl.program_id(1) * n_queries  # global position of query 0
  q = q_ref[...]  # [n_queries * HIp, DI]; padded heads have zero weight
  w = w_ref[...].astype(jnp.float32)  # [n_queries * HIp]
  queries = first + jax.lax.iota(jnp.int32, n_queries)
  seg_q = seg_q_ref[...]
  n_blocks = out_ref.shape[1] // block_k
  n_causal = (first + n_queries - 1) // block_k + 1

  def score_block(j, _):
    cols = j * block_k + jax.lax.iota(jnp.int32, block_k)
    keys = k_ref[pl.ds(j * block_k, block_k), :]  # [block_k, DI]
    dots = plgpu.dot(q, keys, trans_b=True).astype(jnp.float32)  # [rows, block_k]
    weighted = jnp.maximum(dots, 0.0) * w[:, None]
    seg_k = seg_k_ref[pl.ds(j * block_k, block_k)]
    scores = weighted.reshape(n_queries, heads, block_k).sum(axis=1)  # per query
    ok = (cols[None, :] <= queries[:, None]) & (seg_k[None, :] == seg_q[:, None])
    out_ref[:, pl.ds(j * block_k, block_k)] = jnp.where(ok, scores, -jnp.inf)

  def fill_future_block(j, _):
    out_ref[:, pl.ds(j * block_k, block_k)] = jnp.full((n_queries, block_k), -jnp.inf, jnp.float32)

  jax.lax.fori_loop(0, n_causal, score_block, None)
  if fill_future:
    jax.lax.fori_loop(n_causal, n_blocks, fill_future_block, None)


def _chunk_scores(start, q_chunk, w_chunk, seg_chunk, k_idx, seg, *, block_k, queries, num_warps,
                  interpret, fill_future=True):
  """Masked fp32 scores [B, chunk, Tp] of queries start .. start + chunk - 1, `queries`
    of them per program (each key block loaded once for all of them); without
    fill_future, each row's key blocks past its program's last query are undefined."""
  b, chunk, hip, di = q_chunk.shape
  tp = k_idx.shape[1]
  rows = queries * hip
  kernel = functools.partial(_score_kernel, block_k=block_k, heads=hip, fill_future=fill_future)
  return pl.pallas_call(
      kernel,
      grid=(b, chunk // queries),
      in_specs=[
          pl.BlockSpec((1,), lambda bi, qi: (0,)),
          pl.BlockSpec((None, rows, di), lambda bi, qi: (bi, qi, 0)),
          pl.BlockSpec((None, rows), lambda bi, qi: (bi, qi)),
          pl.BlockSpec((None, queries), lambda bi, qi: (bi, qi)),
          pl.BlockSpec((None, tp, di), lambda bi, qi: (bi, 0, 0)),
          pl.BlockSpec((None, tp), lambda bi, qi: (bi, 0)),
      ],
      out_specs=pl.BlockSpec((None, queries, tp), lambda bi, qi: (bi, qi, 0)),
      out_shape=jax.ShapeDtypeStruct((b, chunk, tp), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
      interpret=interpret,
      name="sparse_attention_indexer_scores",
  )(start, q_chunk.reshape(b, chunk * hip, di), w_chunk.reshape(b, chunk * hip), seg_chunk, k_idx,
    seg)


SELECTIONS = ("kernel", "threshold", "sort")


def topk_indices(q_idx, k_idx, w, *, top_k: int, segment_ids=None, query_offset=None,
                 selection: str = "kernel", queries_per_program: int = 1, num_warps: int = 4,
                 block_k: int = _BLOCK_K):
  """Per query, the top_k causal same-segment keys by indexer score, int32 [B, T, top_k].

    Same contract as topk_indices_reference: score
    I[t, s] = sum_h w[t, h] * relu(q_idx[t, h] . k_idx[s]); the selected set is the
    top_k keys s <= t of t's segment (ties: smaller index), -1 filling the rest.

    With `query_offset` (an int or a traced int32 scalar), the queries are the range of
    positions query_offset .. query_offset + T - 1 of the keys k_idx [B, Tk, DI] (a
    device's share of a sequence split over devices); segment_ids [B, Tk] are the keys'
    and the indices point into the Tk keys.

    `selection` picks each chunk's top-K from its score rows: "kernel" (the default;
    top_k_kernel.py: one Pallas program per query over its causal keys only), "threshold"
    (threshold_top_k.py: the same counting passes under XLA, over whole rows; faster
    than the sort, with fewer temporaries) or "sort" (jax.lax.top_k). All give the same
    sets (docs/kernel_tuning.md, "Top-K selection").

    `queries_per_program` (a power of 2), `num_warps` and `block_k` (keys per step, a
    power of 2 >= 16) tile the score kernel: one program scores that many consecutive
    queries, loading each key block once for all.
    The kernel is bound by its epilogue (ReLU, weights, head sums), not by the key loads
    or the matmul (float8 inputs gain nothing); defaults chosen by measurement:
    docs/kernel_tuning.md, "Indexer score kernel".
    """
  if selection not in SELECTIONS:
    raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
  if queries_per_program < 1 or queries_per_program & (queries_per_program - 1):
    raise ValueError(f"queries_per_program must be a power of 2, got {queries_per_program}")
  if block_k < 16 or block_k & (block_k - 1):
    raise ValueError(f"block_k must be a power of 2 >= 16, got {block_k}")
  input_checks.check_indexer_inputs(q_idx, k_idx, w, top_k, segment_ids,
                                    queries_are_a_range=query_offset is not None)
  check_head_dim("q_idx", q_idx.shape[3])
  if k_idx.dtype != q_idx.dtype:
    raise ValueError(f"k_idx dtype {k_idx.dtype} must match q_idx dtype {q_idx.dtype}")
  # Integer indices carry no gradient: keep autodiff from linearising the kernel.
  q_idx, k_idx, w = (jax.lax.stop_gradient(x) for x in (q_idx, k_idx, w))
  b, t, hi, _ = q_idx.shape
  tk = k_idx.shape[1]
  offset = jnp.asarray(0 if query_offset is None else query_offset, jnp.int32)
  block_k = block_k if tk >= block_k else max(16, tile_rows(tk))
  tp = -(-tk // block_k) * block_k
  kept = min(top_k, tk)
  chunk = max(1, min(t, CHUNK_SCORE_BYTES // (4 * b * tp)))
  chunk = -(-chunk // queries_per_program) * queries_per_program  # whole programs
  n_chunks = -(-t // chunk)

  hip = tile_rows(hi)  # zero-weight padding heads up to a matmul tile
  q_p = pad_axis(pad_axis(q_idx, 2, hip), 1, n_chunks * chunk)
  w_p = pad_axis(pad_axis(w, 2, hip), 1, n_chunks * chunk)
  seg = (jnp.zeros((b, tk), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32))
  seg_q = pad_axis(jax.lax.dynamic_slice_in_dim(seg, offset, t, axis=1), 1, n_chunks * chunk)
  k_p = pad_axis(k_idx, 1, tp)
  seg_k = pad_axis(seg, 1, tp)  # padded keys lie in the future of every query
  interpret = use_interpret()

  def one_chunk(c):
    start = c * chunk
    sl = lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=1)
    scores = _chunk_scores((offset + start)[None], sl(q_p), sl(w_p), sl(seg_q), k_p, seg_k,
                           block_k=block_k, queries=queries_per_program, num_warps=num_warps,
                           interpret=interpret, fill_future=selection != "kernel")
    if selection == "kernel":  # each query's keys up to itself: the rest is unwritten
      causal = offset + start + jnp.arange(chunk, dtype=jnp.int32) + 1
      return kernel_top_k(scores, kept, jnp.broadcast_to(causal, (b, chunk)))
    if selection == "threshold":
      return threshold_top_k(scores, kept)
    values, idx = jax.lax.top_k(scores, kept)
    return jnp.where(values > -jnp.inf, idx, -1).astype(jnp.int32)

  out = jax.lax.map(one_chunk, jnp.arange(n_chunks, dtype=jnp.int32))  # [n, B, chunk, kept]
  out = out.transpose(1, 0, 2, 3).reshape(b, n_chunks * chunk, kept)[:, :t]
  return pad_axis(out, 2, top_k, -1)

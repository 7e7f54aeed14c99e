"""The in-chunk GLA scores A (kept for the backward's dv) and their gradient, per chunk.

A[t, s] = sum_d q_t[d] k_s[d] exp(b_t[d] - b_s[d]) (b: in-chunk cumulative log decay,
s <= t in one segment), one program per chunk. A chunk whose decays factor
(_chunk_factors) takes one [64, D] x [D, 64] matmul, or one [64, D] x [D, 16] matmul per
key sub-chunk. Others are built per 16-token sub-chunk: blocks below the
diagonal factor the decay through the sub-chunk boundary (_score_rows: both factors
<= 1, so one tensor-core matmul per 16x16 block); diagonal blocks factor through the
sub-chunk's first token where its decays allow (_diagonal_blocks) and otherwise form
each exp(b_t - b_s <= 0) exactly, one key at a time, so decays down to g = -20 per
token stay finite. dA = scale * do v^T needs no decay at all.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention import _chunk_factors as factors
from pallas_kernels.linear_attention import _diagonal_blocks as diag
from pallas_kernels.linear_attention._gla_layout import Grid, scores_shape
from pallas_kernels.linear_attention._inputs import CHUNK as C
from pallas_kernels.linear_attention._pallas_common import (F32, N_SUB, SUB, chunk_call,
                                                            compute_dtype, iota, masked_exp, mm,
                                                            rows, store_decayed_rows)
from pallas_kernels.linear_attention._score_rows import (edge_decay, store_diagonal,
                                                         store_row_blocks)


def _diag_scores(q_i, b_i, r_i, k_ref, b_ref, r_ref, start):
  """Scores of one 16x16 diagonal block: one matmul, or exact one key column at a time."""
  b_r = rows(b_ref, start, 1)
  same = r_i[:, None] == r_ref[pl.ds(start, SUB)][None, :]

  def factored(q_i, b_i):
    down, up = diag.decay_factors(b_i, b_r)
    a = diag.f32_mm(q_i * down, rows(k_ref, start, SUB) * up, trans_b=True)
    return jnp.where(same, diag.lower(a), 0.0)

  def exact(q_i, b_i):
    t = iota(SUB)
    cols = iota(SUB, 1, (SUB, SUB))

    def column(j, a):
      k_j, b_j = rows(k_ref, start + j, 1), rows(b_ref, start + j, 1)
      ok = (t >= j) & (r_i == jnp.max(r_ref[pl.ds(start + j, 1)]))
      col = jnp.where(ok, jnp.sum(q_i * k_j * masked_exp(b_i - b_j), axis=1), 0.0)
      return a + jnp.where(cols == j, col[:, None], 0.0)

    return jax.lax.fori_loop(0, SUB, column, jnp.zeros((SUB, SUB), F32))

  return diag.choose(b_i, b_r, factored, exact, q_i, b_i)


def _sub_chunk_rows(q_ref, k_ref, b_ref, r_ref, a_ref, start, cd):
  """Rows [start, start + 16) of A from 16x16 blocks: any decay."""
  q_i, b_i, r_i = rows(q_ref, start, SUB), rows(b_ref, start, SUB), r_ref[pl.ds(start, SUB)]
  b_edge = edge_decay(b_ref, start)
  store_row_blocks([(a_ref, q_i * masked_exp(b_i - b_edge), cd)], k_ref, b_ref, r_ref, start,
                   b_edge, out_row=start)
  store_diagonal(a_ref, _diag_scores(q_i, b_i, r_i, k_ref, b_ref, r_ref, start), start,
                 out_row=start)


def _scores_kernel(q_ref, k_ref, b_ref, r_ref, *refs, cd, decayed):
  """The chunk's [C, C] scores in the chunk's layout (_chunk_factors): one matmul, one
    column block per key sub-chunk, or one row block per sub-chunk. With `decayed`, also
    qg = q exp(b) carry_in and kg = k exp(b_last - b) in_last (compute dtype: the operands
    of the fused forward's products)."""
  b, r = rows(b_ref, 0, C), r_ref[...]
  if decayed:
    ci_ref, il_ref, a_ref, qg_ref, kg_ref = refs
    store_decayed_rows(q_ref, k_ref, b_ref, ci_ref, il_ref, qg_ref, kg_ref, b)
  else:
    a_ref, = refs

  def store(start, a):
    """Columns [start, start + n) of A from their unmasked products a [C, n]."""
    n = a.shape[1]
    t, s = iota(C, 0, (C, n)), start + iota(n, 1, (C, n))
    keep = (s <= t) & (r[:, None] == r_ref[pl.ds(start, n)][None, :])
    a_ref[:, pl.ds(start, n)] = jnp.where(keep, a, 0.0).astype(a_ref.dtype)

  def factored(anchors):
    query = rows(q_ref, 0, C) * factors.factors(b, anchors.per_token())[0]
    factors.by_key_blocks(
        anchors, k_ref, b_ref, b,
        lambda start, keys, bridge: store(start, diag.f32_mm(bridge(query), keys, trans_b=True)))

  def by_sub_chunks():

    def row_block(i, carry):
      _sub_chunk_rows(q_ref, k_ref, b_ref, r_ref, a_ref, pl.multiple_of(i * SUB, SUB), cd)
      return carry

    jax.lax.fori_loop(0, N_SUB, row_block, 0)

  anchors, factored_ok = factors.anchors(b_ref)
  jax.lax.cond(factored_ok, lambda: factored(anchors), by_sub_chunks)


def _dscores_kernel(v_ref, r_ref, do_ref, da_ref, dat_ref, *, scale, cd):
  """dA = scale * do v^T on the causal same-segment pairs, and its transpose."""
  v, do, r = v_ref[...], do_ref[...], r_ref[...]
  t, s = iota(C, 0, (C, C)), iota(C, 1, (C, C))
  same = r[:, None] == r[None, :]
  da_ref[...] = jnp.where(same & (s <= t), scale * mm(do, v, cd, trans_b=True), 0.0)
  dat_ref[...] = jnp.where(same & (s >= t), scale * mm(v, do, cd, trans_b=True), 0.0)


def chunk_scores(q, k, b, runs, *, interpret, num_warps=4, num_stages=2, decayed_with=None):
  """The in-chunk scores A [B, H, NT, C, C] (unscaled, zero above the diagonal) in the
    compute dtype: every use of A is a matmul operand in that dtype (A v, A^T do);
    num_stages software-pipelines the loads of the loops over earlier sub-chunks. With
    decayed_with = (carry_in, in_last): (A, qg, kg), qg and kg [B, Tp, H, Dk] in the
    compute dtype (see _scores_kernel)."""
  B, Tp, H, Dk = q.shape
  g = Grid()
  cd = compute_dtype(q.dtype)
  specs, out_specs, outs = [g.chunk(Dk), g.chunk(Dk), g.chunk(Dk), g.flags()], \
      g.scores(), scores_shape(B, H, Tp, cd)
  flags = ()
  if decayed_with is not None:
    flags = tuple(decayed_with)
    specs += [g.flags(), g.flags()]
    out_specs = (out_specs, g.chunk(Dk), g.chunk(Dk))
    outs = (outs, jax.ShapeDtypeStruct(q.shape, cd), jax.ShapeDtypeStruct(q.shape, cd))
  return chunk_call(
      functools.partial(_scores_kernel, cd=cd, decayed=decayed_with is not None),
      (B, H, Tp // C, 1),
      specs,
      out_specs,
      outs,
      num_warps=num_warps,
      interpret=interpret,
      name="gla_chunk_scores",
      num_stages=num_stages,
  )(q, k, b, runs, *flags)


def chunk_score_grads(v, runs, do, *, scale, interpret, num_warps=4):
  """dA = scale * do v^T on causal same-segment pairs [B, H, NT, C, C], and dA transposed."""
  B, Tp, H, Dv = v.shape
  g = Grid()
  return chunk_call(
      functools.partial(_dscores_kernel, scale=scale, cd=compute_dtype(v.dtype)),
      (B, H, Tp // C, 1),
      [g.chunk(Dv), g.flags(), g.chunk(Dv)],
      (g.scores(), g.scores()),
      (scores_shape(B, H, Tp),) * 2,
      num_warps=num_warps,
      interpret=interpret,
      name="gla_chunk_score_grads",
  )(v, runs, do)

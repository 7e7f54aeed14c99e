"""The in-chunk GLA scores A (kept for the backward's dv) and their gradient, per chunk.

A[t, s] = sum_d q_t[d] k_s[d] exp(b_t[d] - b_s[d]) (b: in-chunk cumulative log decay, s
<= t in one segment), one program per chunk. A chunk whose decays factor
(_chunk_factors: WHOLE_CHUNK, HALVES) takes one [64, D] x [D, 64] matmul, or two. Others
are built per 16-token sub-chunk: blocks below the diagonal factor the decay through the
sub-chunk boundary (_score_rows: both factors <= 1, so one tensor-core matmul per 16x16
block); diagonal blocks factor through the sub-chunk's first token where its decays
allow (_diagonal_blocks) and otherwise form each exp(b_t - b_s <= 0) exactly, one key at
a time, so decays down to g = -20 per token stay finite. The kernels come in the forms of
_chunk_factors.SCORE_KERNELS (chunk_scores(form=...)): one kernel branching per chunk (the
default) or one kernel per layout over the first one's output; either can sum the decays
on its way (from_gates), and the one kernel can write no more of their sums than the
fused forward alone reads after it (summed_rows="chunk_ends"). dA = scale * do v^T needs no
decay at all.
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
                                                            chunk_decays, chunk_ends_asked,
                                                            compute_dtype, iota, masked_exp, mm,
                                                            rows, store_decayed_rows, store_summed,
                                                            store_where)
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


def _store_columns(r_ref, a_ref, start, region, a):
  """Columns [start, start + n) of A from their unmasked products a [C, n], where region
    (None: everywhere)."""
  n = a.shape[1]
  t, s = iota(C, 0, (C, n)), start + iota(n, 1, (C, n))
  keep = (s <= t) & (r_ref[...][:, None] == r_ref[pl.ds(start, n)][None, :])
  store_where(a_ref, start, region, jnp.where(keep, a, 0.0))


def _whole_chunk(q_ref, k_ref, b, r_ref, a_ref, operand):
  """A of a WHOLE_CHUNK chunk: one matmul of `operand` dtype operands (b: its rows, loaded)."""
  factors.whole_chunk_products(
      lambda: rows(k_ref, 0, C), b, (lambda: rows(q_ref, 0, C),),
      lambda start, region, a: _store_columns(r_ref, a_ref, start, region, a), (operand,))


# The HALVES products 64 channels at a time, both merged in registers into one unmasked
# [C, C] store (the pairs across as a [C, C] product too): faster than all channels at once
# and two masked stores (docs/kernel_tuning.md, "GLA tiling")
HALVES_BLOCK_D = 64
# The pairs across the halves from the inside's operands (_chunk_factors.HALVES_ACROSS_FORMS):
# faster than their own exp with strong gates (docs/performance.md, "The pairs across the
# halves from the inside's operands")
HALVES_ACROSS = "bridged"

# With summed_rows="chunk_ends", the HALVES chunks take b's rows held in registers (split
# into channel blocks there) instead of writing them and reading them back
HALVES_HELD_ROWS = True


def _halves(q_ref, k_ref, b_ref, r_ref, a_ref, operand):
  """A of a HALVES chunk: two matmuls of `operand` dtype operands, merged in registers (b_ref:
    as _chunk_factors.halves_products takes it)."""
  kept = []

  def keep(start, region, a):
    del start  # every product spans all C columns
    kept[:] = [jnp.where(region, a, kept[0]) if kept else a]

  factors.halves_products(k_ref, b_ref, (q_ref,), keep, block_d=HALVES_BLOCK_D, dtypes=(operand,),
                          across=HALVES_ACROSS)
  _store_columns(r_ref, a_ref, 0, None, kept[0])


def _by_sub_chunks(q_ref, k_ref, b_ref, r_ref, a_ref, cd):
  """A of any chunk: one row block per sub-chunk."""

  def row_block(i, carry):
    _sub_chunk_rows(q_ref, k_ref, b_ref, r_ref, a_ref, pl.multiple_of(i * SUB, SUB), cd)
    return carry

  jax.lax.fori_loop(0, N_SUB, row_block, 0)


def _decayed_rows(q_ref, k_ref, refs, decayed, b, b_last):
  """(a_ref, the rest of refs): with `decayed`, qg = q exp(b) carry_in and kg = k exp(b_last
    - b) in_last written first (compute dtype: the operands of the fused forward's
    products)."""
  if not decayed:
    return refs[0], refs[1:]
  ci_ref, il_ref, a_ref, qg_ref, kg_ref, *rest = refs
  store_decayed_rows(rows(q_ref, 0, C), rows(k_ref, 0, C), b, b_last, ci_ref, il_ref, qg_ref,
                     kg_ref)
  return a_ref, rest


def _summed(b_ref, refs, from_gates, interpret, chunk_ends=False):
  """(b_ref, b, b_last, refs): _pallas_common.chunk_decays, with from_gates the log decays
    summed into the last of refs, which leaves them."""
  summed_ref, refs = (refs[-1], refs[:-1]) if from_gates else (None, refs)
  return (*chunk_decays(b_ref, summed_ref, from_gates=from_gates, chunk_ends=chunk_ends,
                        interpret=interpret), refs)


def _scores_kernel(q_ref, k_ref, b_ref, r_ref, *refs, cd, decayed, from_gates, interpret, operand,
                   chunk_ends=False):
  """The chunk's [C, C] scores in the chunk's layout (_chunk_factors); with `decayed`, also
    qg and kg (_decayed_rows); with from_gates, b summed here first (_summed), or with
    chunk_ends in registers, its rows written as SUMMED_ROWS' chunk_ends says."""
  b_ref, b, b_last, refs = _summed(b_ref, refs, from_gates, interpret, chunk_ends)
  a_ref, _ = _decayed_rows(q_ref, k_ref, refs, decayed, b, b_last)
  whole = lambda: _whole_chunk(q_ref, k_ref, b, r_ref, a_ref, operand)
  halves = lambda: _halves(q_ref, k_ref, b_ref, r_ref, a_ref, operand)
  sub_chunks = lambda: _by_sub_chunks(q_ref, k_ref, b_ref, r_ref, a_ref, cd)
  if chunk_ends:
    write_rows = lambda: store_summed(b, b_ref, interpret)
    if HALVES_HELD_ROWS:
      halves = lambda: _halves(q_ref, k_ref, factors.HeldRows(b), r_ref, a_ref, operand)
    else:

      def halves():
        write_rows()
        _halves(q_ref, k_ref, b_ref, r_ref, a_ref, operand)

    factors.by_score_layout_from_rows(b, b_ref, write_rows, whole, halves, sub_chunks)
  else:
    factors.by_score_layout(b_ref, whole, halves, sub_chunks)


def _first_pass_kernel(q_ref, k_ref, b_ref, r_ref, *refs, decayed, from_gates, interpret, operand):
  """The first pass: A of the WHOLE_CHUNK chunks, qg and kg of every chunk with `decayed`,
    and every chunk's layout for the later passes; with from_gates, b summed here first
    (_summed)."""
  b_ref, b, b_last, refs = _summed(b_ref, refs, from_gates, interpret)
  a_ref, (flag_ref,) = _decayed_rows(q_ref, k_ref, refs, decayed, b, b_last)
  whole, _ = factors.record_layout(flag_ref, b_ref)  # the later passes read the layout
  jax.lax.cond(whole, lambda: _whole_chunk(q_ref, k_ref, b, r_ref, a_ref, operand), lambda: None)


def _later_pass_kernel(q_ref, k_ref, b_ref, r_ref, flag_ref, _a_in, a_ref, *, layout, cd, operand):
  """A later pass: A of the chunks in `layout` (HALVES or SUB_CHUNKS); its memory is the
    first pass's output, the other chunks' stay as written."""
  args = (q_ref, k_ref, b_ref, r_ref, a_ref)
  if layout == factors.HALVES:
    compute = lambda: _halves(*args, operand)
  else:
    compute = lambda: _by_sub_chunks(*args, cd)
  factors.if_layout(flag_ref, layout, compute)


def _dscores_kernel(v_ref, r_ref, do_ref, da_ref, dat_ref, *, scale, cd):
  """dA = scale * do v^T on the causal same-segment pairs, and its transpose."""
  v, do, r = v_ref[...], do_ref[...], r_ref[...]
  t, s = iota(C, 0, (C, C)), iota(C, 1, (C, C))
  same = r[:, None] == r[None, :]
  da_ref[...] = jnp.where(same & (s <= t), scale * mm(do, v, cd, trans_b=True), 0.0)
  dat_ref[...] = jnp.where(same & (s >= t), scale * mm(v, do, cd, trans_b=True), 0.0)


# The first pass's warps (the one kernel's, four, hold it without spilling:
# experiments/kernel_resources.py)
FACTORED_WARPS = 4


def chunk_scores(q, k, b, runs, *, interpret, num_warps=4, num_stages=2, decayed_with=None,
                 form="one_kernel", from_gates=False, operands="compute", summed_rows="all"):
  """The in-chunk scores A [B, H, NT, C, C] (unscaled, zero above the diagonal) in the
    compute dtype: every use of A is a matmul operand in that dtype (A v, A^T do);
    num_stages software-pipelines the loads of the loops over earlier sub-chunks. With
    decayed_with = (carry_in, in_last): (A, qg, kg), qg and kg [B, Tp, H, Dk] in the
    compute dtype (see _decayed_rows). form (_chunk_factors.SCORE_KERNELS): one kernel
    that branches per chunk (num_warps); by_layout, three kernels, the WHOLE_CHUNK
    chunks' (FACTORED_WARPS), then the HALVES ones' and the SUB_CHUNKS ones' (num_warps).
    b: the in-chunk cumulative log decay [B, Tp, H, Dk], or with from_gates the log decays
    g, which the (first) kernel sums; b [B, Tp, H, Dk] fp32 then comes last of
    a tuple (with A alone, (A, b)); summed_rows: the rows of that b written, one of
    _pallas_common.SUMMED_ROWS ("chunk_ends": the one kernel's form alone). operands: the
    factored products' operand dtype, one of _chunk_factors.SCORE_OPERANDS."""
  if form not in factors.SCORE_KERNELS:
    raise ValueError(f"form = {form!r}: expected one of {list(factors.SCORE_KERNELS)}")
  chunk_ends = chunk_ends_asked(summed_rows, from_gates)
  if chunk_ends and form != "one_kernel":
    raise ValueError(f"summed_rows = 'chunk_ends' needs the one kernel's form; got {form!r}")
  B, Tp, H, Dk = q.shape
  g = Grid()
  cd = compute_dtype(q.dtype)
  operand = factors.operand_dtype(operands, cd)
  specs, out_specs, outs = [g.chunk(Dk), g.chunk(Dk), g.chunk(Dk), g.flags()], \
      (g.scores(),), (scores_shape(B, H, Tp, cd),)
  flags = ()
  decayed = decayed_with is not None
  if decayed:
    flags = tuple(decayed_with)
    specs += [g.flags(), g.flags()]
    out_specs += (g.chunk(Dk), g.chunk(Dk))
    outs += (jax.ShapeDtypeStruct(q.shape, cd), jax.ShapeDtypeStruct(q.shape, cd))
  grid, launch = (B, H, Tp // C, 1), dict(interpret=interpret, num_stages=num_stages)
  kernel_kw = dict(from_gates=from_gates, interpret=interpret, operand=operand)
  if from_gates:  # the summed decays: the kernel's last output
    summed_spec, summed = (g.chunk(Dk),), (jax.ShapeDtypeStruct(q.shape, F32),)
  else:
    summed_spec, summed = (), ()
  result = lambda out: tuple(out) if decayed or from_gates else out[0]
  if form == "one_kernel":
    out = chunk_call(
        functools.partial(_scores_kernel, cd=cd, decayed=decayed, chunk_ends=chunk_ends,
                          **kernel_kw), grid, specs, out_specs + summed_spec, outs + summed,
        num_warps=num_warps, name="gla_chunk_scores", **launch)(q, k, b, runs, *flags)
    return result(out)
  out = list(
      chunk_call(functools.partial(_first_pass_kernel, decayed=decayed, **kernel_kw), grid, specs,
                 out_specs + (g.layout_flag(),) + summed_spec, outs + (jax.ShapeDtypeStruct(
                     (B, H, Tp // C, C), jnp.int32),) + summed, num_warps=FACTORED_WARPS,
                 name="gla_chunk_scores_whole_chunk", **launch)(q, k, b, runs, *flags))
  b = out.pop() if from_gates else b
  layout = out.pop()
  for code, name in ((factors.HALVES, "halves"), (factors.SUB_CHUNKS, "sub_chunks")):
    out[0] = chunk_call(functools.partial(_later_pass_kernel, layout=code, cd=cd, operand=operand),
                        grid, specs[:4] + [g.layout_flag(), g.scores()], g.scores(), outs[0],
                        num_warps=num_warps, name=f"gla_chunk_scores_{name}",
                        input_output_aliases={5: 0}, **launch)(q, k, b, runs, layout, out[0])
  return result(out + [b] * from_gates)


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

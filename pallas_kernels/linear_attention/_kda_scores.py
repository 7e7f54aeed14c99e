"""In-chunk KDA scores, one program per (batch row, head, chunk).

With b the in-chunk cumulative log decay, the chunk's
  A_kk[t, s] = beta_t k_t . (k_s exp(b_t - b_s))   s < t, same run (fp32: the inverse
                                                   T = (I + A_kk)^-1 amplifies rounding)
  A_qk[t, s] = q_t . (k_s exp(b_t - b_s))          s <= t, same run
and qg = q exp(b) ci and kg = k exp(b_last - b) il (see _kda_intra). A chunk whose decays
factor (_chunk_factors: WHOLE_CHUNK, HALVES) takes one matmul for each score matrix, or
two, on operands in the compute dtype or fp32 (_chunk_factors.SCORE_OPERANDS). Others go by
16-token sub-chunks: keys of earlier sub-chunks are one block (_score_rows: one
tensor-core matmul each for A_kk and A_qk); the diagonal block factors through the
sub-chunk's first token where its decays allow (_diagonal_blocks) and is otherwise
formed exactly, one key at a time. The kernels come in the forms of
_chunk_factors.SCORE_KERNELS: one kernel branching per chunk (this module's default), or one
kernel per layout over the first one's outputs (chunked_kda's). The first kernel of the
latter can take q and k unnormalised, scaling what it forms by their inverse norms
(_RowScales) and writing the normalised rows for the kernels after it (in the forward
alone, for the SUB_CHUNKS kernel's chunks: the HALVES kernel scales its operands' rows
itself, _NormalisedRows), and the log decays in place of b, which it sums
(_pallas_common.sum_decays; or in registers, writing no more of b than is read after it:
summed_rows="chunk_ends").
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention import _chunk_factors as factors
from pallas_kernels.linear_attention import _diagonal_blocks as diag
from pallas_kernels.linear_attention import _kda_layout as L
from pallas_kernels.linear_attention._inputs import inverse_l2_norms, inverse_root
from pallas_kernels.linear_attention._kda_layout import C
from pallas_kernels.linear_attention._kda_solve import (solve_unless_kernel, store_solved,
                                                        write_keys)
from pallas_kernels.linear_attention._pallas_common import (F32, N_SUB, SUB, chunk_columns,
                                                            chunk_decays, chunk_ends_asked,
                                                            flag_column, iota, masked_exp, rows,
                                                            store_decayed_rows, store_summed,
                                                            store_where)
from pallas_kernels.linear_attention._score_rows import (edge_decay, store_diagonal,
                                                         store_row_blocks)


def _diagonal_blocks(q_i, k_i, b_i, k_ref, b_ref, start):
  """16x16 diagonal blocks of A_kk / beta (strict) and A_qk: two matmuls where the
    sub-chunk's decays factor (_diagonal_blocks), else exact, one key at a time."""
  b_r = rows(b_ref, start, 1)

  def factored(q_i, k_i, b_i):
    down, up = diag.decay_factors(b_i, b_r)
    key = k_i * up
    return (diag.lower(diag.f32_mm(k_i * down, key, trans_b=True),
                       strict=True), diag.lower(diag.f32_mm(q_i * down, key, trans_b=True)))

  def exact(q_i, k_i, b_i):
    t, cols = iota(SUB, 0, (SUB, SUB)), iota(SUB, 1, (SUB, SUB))

    def key(j, acc):
      a_kk, a_qk = acc
      k_j = rows(k_ref, start + j, 1) * masked_exp(b_i - rows(b_ref, start + j, 1))
      kk = jnp.sum(k_i * k_j, axis=1)[:, None]
      qk = jnp.sum(q_i * k_j, axis=1)[:, None]
      a_kk = a_kk + jnp.where((cols == j) & (t > j), kk, 0.0)
      a_qk = a_qk + jnp.where((cols == j) & (t >= j), qk, 0.0)
      return a_kk, a_qk

    zero = jnp.zeros((SUB, SUB), F32)
    return jax.lax.fori_loop(0, SUB, key, (zero, zero))

  return diag.choose(b_i, b_r, factored, exact, q_i, k_i, b_i)


def _sub_chunk_rows(q_ref, k_ref, b_ref, beta_ref, r_ref, akk_ref, aqk_ref, start, cd):
  """Rows [start, start + 16) of A_kk and A_qk from 16x16 blocks: any decay."""
  q_i, k_i, b_i = rows(q_ref, start, SUB), rows(k_ref, start, SUB), rows(b_ref, start, SUB)
  beta_i = beta_ref[pl.ds(start, SUB)].astype(F32)[:, None]
  b_edge = edge_decay(b_ref, start)
  to_edge = masked_exp(b_i - b_edge)
  store_row_blocks([(akk_ref, beta_i * k_i * to_edge, cd), (aqk_ref, q_i * to_edge, cd)], k_ref,
                   b_ref, r_ref, start, b_edge, out_row=start)

  kk_d, qk_d = _diagonal_blocks(q_i, k_i, b_i, k_ref, b_ref, start)
  r_i = r_ref[pl.ds(start, SUB)]
  same = r_i[:, None] == r_i[None, :]
  store_diagonal(akk_ref, jnp.where(same, beta_i * kk_d, 0.0), start, out_row=start)
  store_diagonal(aqk_ref, jnp.where(same, qk_d, 0.0), start, out_row=start)


def _store_columns(r_ref, beta_ref, akk_ref, aqk_ref, start, region, a_kk, a_qk, scales=None,
                   row=None):
  """Columns [start, start + n) of A_kk and A_qk from their unmasked products [C, n], where
    region (None: everywhere); with `row`, products [m, n] of rows [row, row + m) alone;
    with scales (_RowScales; n = C), the products of the raw rows scaled to those of the
    L2-normalised rows."""
  m, n = a_kk.shape
  rows_at = slice(None) if row is None else pl.ds(row, m)
  t, s = (row or 0) + iota(m, 0, (m, n)), start + iota(n, 1, (m, n))
  same = r_ref[rows_at][:, None] == r_ref[pl.ds(start, n)][None, :]
  beta = beta_ref[rows_at].astype(F32)[:, None]
  if scales is not None:
    a_kk, a_qk, beta = a_kk * scales.k_row, a_qk * (scales.q * scales.k_row), beta * scales.k
  store_where(akk_ref, start, region, jnp.where(same & (s < t), beta * a_kk, 0.0), row)
  store_where(aqk_ref, start, region, jnp.where(same & (s <= t), a_qk, 0.0), row)


def _whole_chunk(q, k, b, beta_ref, r_ref, akk_ref, aqk_ref, operand, scales=None):
  """A_kk and A_qk of a WHOLE_CHUNK chunk: one matmul each of `operand` dtype operands (q,
    k: loaders of its rows; b: its rows, loaded; scales: as _store_columns takes them)."""
  factors.whole_chunk_products(
      k, b, (k, q), lambda start, region, a_kk, a_qk: _store_columns(
          r_ref, beta_ref, akk_ref, aqk_ref, start, region, a_kk, a_qk, scales), (operand,) * 2)


# The HALVES products 64 channels at a time: two queries' operands over all of D = 128 do
# not fit the registers (experiments/kernel_resources.py)
HALVES_BLOCK_D = 64
# The pairs across the halves by their own exp (_chunk_factors.HALVES_ACROSS_FORMS): from the
# inside's operands, the HALVES kernel at four warps holds four [C, C] sums for its two
# queries and spills, and ran slower (docs/performance.md, "The pairs across the halves from
# the inside's operands")
HALVES_ACROSS = "own_exp"


def _halves(q_ref, k_ref, b_ref, beta_ref, r_ref, akk_ref, aqk_ref, operand, normalize=False,
            block_d=None):
  """A_kk and A_qk of a HALVES chunk: two [C, C] matmuls each, masked to the pairs inside
    the halves and to those across (_chunk_factors.halves_products, by HALVES_ACROSS), of
    `operand` dtype operands, block_d channels at a time (None: HALVES_BLOCK_D); with
    `normalize`, of q and k as given, their rows scaled by their inverse norms
    (_NormalisedRows)."""
  block_d = block_d or HALVES_BLOCK_D
  if normalize:
    q_ref, k_ref = (_NormalisedRows.of(ref, block_d) for ref in (q_ref, k_ref))
  factors.halves_products(
      k_ref, b_ref, (k_ref, q_ref), lambda start, region, a_kk, a_qk: _store_columns(
          r_ref, beta_ref, akk_ref, aqk_ref, start, region, a_kk, a_qk), block_d=block_d,
      dtypes=(operand,) * 2, across=HALVES_ACROSS)


class _NormalisedRows:
  """A chunk's [C, D] ref read as its L2-normalised rows: each load (all C rows, any
    channels) times the rows' inverse norms, in fp32. The HALVES products take their
    operands so: scaling the products instead holds the keys' norms as a row too, and
    spills (experiments/kernel_resources.py)."""

  def __init__(self, ref, scale):
    self.ref, self.scale, self.shape = ref, scale, ref.shape

  @classmethod
  def of(cls, ref, block_d):
    """The rows of ref, their squares summed block_d channels at a time (no [C, D] fp32
      row block held: a kernel short of registers)."""
    block = min(block_d, ref.shape[-1])
    squares = [
        jnp.sum(jnp.square(ref[pl.ds(0, C), pl.ds(d, block)].astype(F32)), axis=1)
        for d in range(0, ref.shape[-1], block)
    ]
    return cls(ref, inverse_root(functools.reduce(jnp.add, squares))[:, None])

  def __getitem__(self, index):
    assert (index[0].start, index[0].size) == (0, C), "whole-chunk row loads only"
    return self.ref[index].astype(F32) * self.scale


class _RowScales(NamedTuple):
  """The inverse L2 norms of a chunk's q rows (q [C, 1]) and k rows (k [C, 1], k_row
    [1, C]). Normalising a row scales every product it enters, so the first scores kernel
    forms its scores and decayed rows from the raw rows and scales those: no normalised
    [C, D] operand is formed, rounded or reloaded (docs/performance.md, "The L2 norm as
    row scales")."""
  q: jax.Array
  k: jax.Array
  k_row: jax.Array

  @classmethod
  def of(cls, q, k):
    """The scales of the loaded rows q, k [C, D] (fp32)."""
    inverse_k = inverse_l2_norms(k)
    return cls(inverse_l2_norms(q)[:, None], inverse_k[:, None], inverse_k[None, :])


def _store_normalised(q_ref, k_ref, scales, normed_refs):
  """The chunk's L2-normalised q and k rows into normed_refs (their dtypes), for the
    kernels after the first and the backward."""
  for ref, scale, out in zip((q_ref, k_ref), (scales.q, scales.k), normed_refs):
    out[...] = (rows(ref, 0, C) * scale).astype(out.dtype)


def _loader(ref):
  """A loader of the chunk's [C, D] fp32 rows (what the WHOLE_CHUNK products take: they
    load at each use, the rows held across the pass spill)."""
  return lambda: rows(ref, 0, C)


def _store_write_keys(k, b, beta_ref, ci_ref, kw_ref, cols=None):
  """kw = beta k exp(b) carry_in, the keys the solve turns into w (kw_ref's dtype, that of
    its product's operands), so that the solve reads neither k nor b (cols: as
    store_decayed_rows takes them)."""
  kw = write_keys(k, b, beta_ref[...].astype(F32)[:, None], lambda: flag_column(ci_ref, 0, C))
  kw_ref[chunk_columns(cols)] = kw.astype(kw_ref.dtype)


def _rows_written(q_ref, k_ref, b, b_last, beta_ref, ci_ref, il_ref, qg_ref, kg_ref, kw_ref,
                  normalize=False):
  """The chunk's _RowScales with `normalize` (else None), after qg, kg and kw (unless kw_ref
    is None) are written, from normalised rows where asked (b: the chunk's rows of b, b_last
    its last)."""
  q, k = rows(q_ref, 0, C), rows(k_ref, 0, C)
  scales = _RowScales.of(q, k) if normalize else None
  if normalize:
    q, k = q * scales.q, k * scales.k
  store_decayed_rows(q, k, b, b_last, ci_ref, il_ref, qg_ref, kg_ref)
  if kw_ref is not None:
    _store_write_keys(k, b, beta_ref, ci_ref, kw_ref)
  return scales


def _by_sub_chunks(q_ref, k_ref, b_ref, beta_ref, r_ref, akk_ref, aqk_ref, cd):
  """A_kk and A_qk of any chunk: one row block per sub-chunk."""

  def row_block(i, carry):
    _sub_chunk_rows(q_ref, k_ref, b_ref, beta_ref, r_ref, akk_ref, aqk_ref,
                    pl.multiple_of(i * SUB, SUB), cd)
    return carry

  jax.lax.fori_loop(0, N_SUB, row_block, 0)


def _scores_kernel(q_ref, k_ref, b_ref, beta_ref, r_ref, ci_ref, il_ref, qg_ref, kg_ref, kw_ref,
                   akk_ref, aqk_ref, *, cd, operand):
  """One chunk: qg, kg, kw, and A_kk, A_qk in the chunk's layout (_chunk_factors)."""
  b = rows(b_ref, 0, C)
  _rows_written(q_ref, k_ref, b, rows(b_ref, C - 1, 1), beta_ref, ci_ref, il_ref, qg_ref, kg_ref,
                kw_ref)
  refs = (q_ref, k_ref, b_ref, beta_ref, r_ref, akk_ref, aqk_ref)
  factors.by_score_layout(
      b_ref, lambda: _whole_chunk(_loader(q_ref), _loader(k_ref), b, *refs[3:], operand),
      lambda: _halves(*refs, operand), lambda: _by_sub_chunks(*refs, cd))


def _first_pass_kernel(q_ref, k_ref, b_ref, beta_ref, r_ref, ci_ref, il_ref, qg_ref, kg_ref, kw_ref,
                       akk_ref, aqk_ref, flag_ref, *extra_refs, keys_of_halves, keep_normalized,
                       normalize, from_gates, interpret, operand, halves_normalize=False,
                       chunk_ends=False):
  """The first pass: qg, kg and kw of every chunk (keys_of_halves=False: but the HALVES
    ones'), A_kk and A_qk of the WHOLE_CHUNK chunks, and every chunk's layout for the later
    passes; with `normalize` (extra_refs: the normalised q, k), all of it from q and k L2-normalised (_RowScales), and the normalised
    rows written for the later passes' chunks (keep_normalized: for every chunk;
    halves_normalize: for the SUB_CHUNKS ones alone, the HALVES kernel normalising its
    own); with from_gates, b_ref holds the log decays g and b is summed here into the last of
    extra_refs (sum_decays), or with chunk_ends in registers, its rows written as
    _pallas_common.SUMMED_ROWS' chunk_ends says."""
  normed_refs = extra_refs[:2] if normalize else ()
  # with from_gates b_ref holds g; from here on, the b it sums to
  b_ref, b, b_last = chunk_decays(b_ref, extra_refs[-1] if from_gates else None,
                                  from_gates=from_gates, chunk_ends=chunk_ends, interpret=interpret)
  scales = _rows_written(q_ref, k_ref, b, b_last, beta_ref, ci_ref, il_ref, qg_ref, kg_ref,
                         kw_ref if keys_of_halves else None, normalize)
  if chunk_ends:
    whole, layout = factors.record_layout_from_rows(flag_ref, b,
                                                    lambda: store_summed(b, b_ref, interpret))
  else:
    whole, layout = factors.record_layout(flag_ref, b_ref)
  if normed_refs:
    store = lambda: _store_normalised(q_ref, k_ref, scales, normed_refs)
    if keep_normalized:
      store()
    elif halves_normalize:
      jax.lax.cond(layout == factors.SUB_CHUNKS, store, lambda: None)
    else:  # the chunks of the later kernels alone
      jax.lax.cond(whole, lambda: None, store)
  if not keys_of_halves:  # the HALVES chunks' kernel forms its kw itself
    k = lambda: rows(k_ref, 0, C) * (1.0 if scales is None else scales.k)
    jax.lax.cond(layout == factors.HALVES, lambda: None,
                 lambda: _store_write_keys(k(), b, beta_ref, ci_ref, kw_ref))
  whole_chunk = lambda: _whole_chunk(_loader(q_ref), _loader(k_ref), b, beta_ref, r_ref, akk_ref,
                                     aqk_ref, operand, scales)
  jax.lax.cond(whole, whole_chunk, lambda: None)


def _rows_by_blocks(q, k, b_ref, beta_ref, ci_ref, il_ref, qg_ref, kg_ref, kw_ref, normed=None):
  """A chunk's qg, kg and kw from q and k (its rows as _NormalisedRows), HALVES_BLOCK_D
    channels at a time; normed(cols, q, k), where given, takes each block's normalised rows."""
  D = b_ref.shape[-1]
  block = min(HALVES_BLOCK_D, D)
  for d in range(0, D, block):
    cols = pl.ds(d, block)
    b = b_ref[pl.ds(0, C), cols].astype(F32)
    q_d, k_d = q[pl.ds(0, C), cols], k[pl.ds(0, C), cols]
    store_decayed_rows(q_d, k_d, b, b_ref[pl.ds(C - 1, 1), cols].astype(F32), ci_ref, il_ref,
                       qg_ref, kg_ref, cols)
    _store_write_keys(k_d, b, beta_ref, ci_ref, kw_ref, cols)
    if normed is not None:
      normed(cols, q_d, k_d)


def _halves_first_kernel(q_ref, k_ref, b_ref, beta_ref, r_ref, ci_ref, il_ref, flag_ref, qg_ref,
                         kg_ref, kw_ref, akk_ref, aqk_ref, nq_ref, nk_ref, *, operand):
  """The first kernel of the HALVES-first form, the layouts given (flag_ref): a HALVES chunk
    whole, from q and k as given, normalised here (_NormalisedRows): its qg, kg and kw,
    HALVES_BLOCK_D channels at a time, and A_kk, A_qk; a SUB_CHUNKS chunk's qg, kg, kw and
    its normalised q, k rows (nq_ref, nk_ref, what the SUB_CHUNKS kernel reads); nothing of a
    WHOLE_CHUNK chunk (_whole_chunks_kernel's)."""
  layout = jnp.max(flag_ref[...])

  def store_normalised(cols, q, k):
    for ref, x in ((nq_ref, q), (nk_ref, k)):
      ref[pl.ds(0, C), cols] = x.astype(ref.dtype)

  def compute():
    sub_chunks = layout == factors.SUB_CHUNKS
    q, k = (_NormalisedRows.of(ref, HALVES_BLOCK_D) for ref in (q_ref, k_ref))
    _rows_by_blocks(q, k, b_ref, beta_ref, ci_ref, il_ref, qg_ref, kg_ref, kw_ref,
                    lambda *a: jax.lax.cond(sub_chunks, lambda: store_normalised(*a), lambda: None))
    jax.lax.cond(sub_chunks, lambda: None,
                 lambda: _halves(q, k, b_ref, beta_ref, r_ref, akk_ref, aqk_ref, operand))

  jax.lax.cond(layout == factors.WHOLE_CHUNK, lambda: None, compute)


def _whole_chunks_kernel(q_ref, k_ref, b_ref, beta_ref, r_ref, ci_ref, il_ref, flag_ref, *refs,
                         operand):
  """A WHOLE_CHUNK chunk (its layout given) whole, as the first kernel forms it from q and k
    normalised (its rows scaled: _RowScales), into the HALVES-first kernel's outputs (refs:
    those outputs given, then the same aliased), or, every chunk WHOLE_CHUNK, into its own
    (refs: those alone)."""
  qg_ref, kg_ref, kw_ref, akk_ref, aqk_ref = refs[-5:]

  def compute():
    b = rows(b_ref, 0, C)
    scales = _rows_written(q_ref, k_ref, b, rows(b_ref, C - 1, 1), beta_ref, ci_ref, il_ref, qg_ref,
                           kg_ref, kw_ref, normalize=True)
    _whole_chunk(_loader(q_ref), _loader(k_ref), b, beta_ref, r_ref, akk_ref, aqk_ref, operand,
                 scales)

  factors.if_layout(flag_ref, factors.WHOLE_CHUNK, compute)


def _later_pass_kernel(q_ref, k_ref, b_ref, beta_ref, r_ref, flag_ref, _akk_in, _aqk_in, akk_ref,
                       aqk_ref, *, layout, cd, operand, normalize=False):
  """A later pass: A_kk and A_qk of the chunks in `layout` (HALVES or SUB_CHUNKS); their
    memory is the first pass's outputs, the other chunks' stay as written. normalize (HALVES):
    q and k as given, normalised here (_halves)."""
  refs = (q_ref, k_ref, b_ref, beta_ref, r_ref, akk_ref, aqk_ref)
  if layout == factors.HALVES:
    compute = lambda: _halves(*refs, operand, normalize)
  else:
    compute = lambda: _by_sub_chunks(*refs, cd)
  factors.if_layout(flag_ref, layout, compute)


# The scores with the solve in place (chunk_scores_and_solve): the HALVES pass keeps its
# chunk's A_kk in registers and solves it there (_kda_solve), writing w, u0 (and T) instead of
# A_kk; the other chunks' A_kk and kw go through memory to the solve's kernel. The WHOLE_CHUNK
# pass solving in place too ran slower: its code outgrew the SM's instruction cache
# (docs/kernel_tuning.md, "Code size").


def _kept_scores(r_ref, beta, aqk_ref):
  """(store, a_kk): a store for the products (factors.*_products, each [C, C] over a region,
    None: all) that writes A_qk at once and merges A_kk into one [C, C] value in registers
    (two held at once spill: experiments/kernel_resources.py), each masked as
    _store_columns masks them (beta [C, 1]); a_kk() is that value."""
  t, s = iota(C, 0, (C, C)), iota(C, 1, (C, C))
  same = r_ref[...][:, None] == r_ref[...][None, :]
  kept = []

  def store(start, region, a_kk, a_qk):
    del start  # every product here spans all C columns
    store_where(aqk_ref, 0, region, jnp.where(same & (s <= t), a_qk, 0.0))
    kept[:] = [a_kk if region is None else jnp.where(region, a_kk, kept[0] if kept else 0.0)]

  return store, lambda: jnp.where(same & (s < t), beta * kept[0], 0.0)


def _halves_solving_kernel(q_ref, k_ref, b_ref, beta_ref, r_ref, ci_ref, v_ref, flag_ref, _aqk_in,
                           aqk_ref, w_ref, u0_ref, *inverse_ref, cd, interpret, operand):
  """The HALVES pass with the solve: A_qk of the HALVES chunks into the first pass's output,
    their w, u0 (and T) into arrays the solve's kernel completes with the other chunks'."""

  def solve():
    beta = beta_ref[...].astype(F32)[:, None]
    store, a_kk = _kept_scores(r_ref, beta, aqk_ref)
    factors.halves_products(k_ref, b_ref, (k_ref, q_ref), store, block_d=HALVES_BLOCK_D,
                            dtypes=(operand,) * 2, across=HALVES_ACROSS)
    kw_cols = lambda cols: write_keys(k_ref[:, cols].astype(F32), b_ref[:, cols].astype(F32), beta,
                                      lambda: flag_column(ci_ref, 0, C))
    store_solved(a_kk(), kw_cols, v_ref, lambda: beta, w_ref, u0_ref, inverse_ref, cd=cd,
                 interpret=interpret, unrolled=False)

  factors.if_layout(flag_ref, factors.HALVES, solve)


# The first pass's warps: four ran faster than eight (docs/kernel_tuning.md, "KDA in-chunk
# scores"); it spills little since it takes WHOLE_CHUNK chunks alone. Normalising q and k
# too, it spills at four warps (304 bytes a thread) and its code outgrows the instruction
# cache; at sixteen it holds half the registers and code of eight, with twice the warps to
# hide each other's latency, and ran faster than eight in every regime once the HALVES
# chunks have a kernel of their own (docs/kernel_tuning.md, "KDA in-chunk scores").
FACTORED_WARPS = 4
NORMALIZING_WARPS = 16
# (The HALVES chunks' scores in the first kernel, from the norms it has formed, lost to
# their own kernel at sixteen warps, and their code slowed the WHOLE_CHUNK chunks, which
# never run it: docs/performance.md, "The first scores kernel at sixteen warps".)
# In the forward alone with b given summed (HALVES_ROWS_FORMS):
#   False         the first kernel over every chunk writes every chunk's qg, kg and kw, the
#                 HALVES and SUB_CHUNKS kernels after it;
#   halves_first  the layouts first (six rows of b a chunk in XLA, _chunk_factors.
#                 score_layout_flags, or from the in-chunk sum: LAYOUTS_FROM_SUM), then the
#                 HALVES chunks' kernel, which writes their qg, kg and kw from the q, k and b
#                 it holds anyway, and the SUB_CHUNKS chunks' rows too, then the WHOLE_CHUNK
#                 chunks' kernel only where a chunk takes that layout: with strong gates no
#                 kernel reads a chunk's rows twice (_halves_first_pass). The default: 8-10%
#                 faster with strong gates, 1-2% slower with mild or KDA-initialisation ones,
#                 where every chunk is WHOLE_CHUNK (docs/kernel_tuning.md, "KDA in-chunk
#                 scores"). (The HALVES chunks' rows in their own kernel after the first
#                 one, which read six rows of b for each of them, lost to it with strong
#                 gates and to False with mild ones: docs/performance.md, "The HALVES-first
#                 forward". Nor did a census, halves_first or False per call by the share
#                 of chunks not WHOLE_CHUNK: docs/performance.md, "Every chunk WHOLE_CHUNK:
#                 one kernel")
HALVES_ROWS_IN_THEIR_KERNEL = "halves_first"
HALVES_ROWS_FORMS = (False, "halves_first")
# For the HALVES-first form, every chunk's layout from the in-chunk sum, from the rows it
# holds (_chunk_cumsum.chunk_cumsum_and_layouts), not from b's rows read again in XLA. An
# option: 0.6% faster with strong gates, 0.6% slower with KDA-initialisation ones
# (docs/performance.md, "Every chunk WHOLE_CHUNK: one kernel")
LAYOUTS_FROM_SUM = False


def layouts_before_scores():
  """Whether the in-chunk sum gives every chunk's layout to the forward alone's scores
    (LAYOUTS_FROM_SUM, with a HALVES_ROWS_IN_THEIR_KERNEL form that takes them before its
    first kernel: chunk_scores' `layouts`)."""
  return LAYOUTS_FROM_SUM and HALVES_ROWS_IN_THEIR_KERNEL == "halves_first"


# In the HALVES-first form, where every chunk is WHOLE_CHUNK, the WHOLE_CHUNK chunks' kernel
# alone, writing every output, by a lax.cond on the layouts: no HALVES-first kernel launched
# over chunks it has nothing to do in (31 us at (1,8192,96,128) with KDA-initialisation
# gates, docs/performance.md, "Every chunk WHOLE_CHUNK: one kernel"). An option: untimed
WHOLE_CHUNKS_ALONE = False

# The HALVES chunks' own kernel's warps (None: chunk_scores' num_warps, as the SUB_CHUNKS
# kernel's); with HALVES_BLOCK_D, its launch to tune (experiments/bench_kernel_constants.py)
HALVES_WARPS = None

# The forms with a first kernel over every chunk, which can normalise q and k and sum the
# decays on its way for the kernels after it
FIRST_KERNEL_FORMS = ("by_layout",)


def _first_pass_warps(factored_warps, normalize):
  return factored_warps or (NORMALIZING_WARPS if normalize else FACTORED_WARPS)


def _first_pass(q, k, b, beta, runs, carry_in, in_last, *, cd, interpret, warps, normalize,
                keys_of_halves, operand, keep_normalized=True, from_gates=False,
                halves_normalize=False, summed_rows="all"):
  """The first kernel of the scores by layout (_first_pass_kernel): (qg, kg, kw, A_kk, A_qk,
    layout flags, q, k as the later kernels read
    them: normalised where asked, for every chunk where keep_normalized, else for the later
    kernels' chunks alone (halves_normalize: the SUB_CHUNKS kernel's), b: the in-chunk
    cumulative decay, summed here from the log decays given as b where from_gates, its rows
    as summed_rows says: _pallas_common.SUMMED_ROWS)."""
  B, Tp, H, Dk = k.shape
  n = Tp // C
  keys, flag, square = L.chunk_rows(Dk), L.chunk_flags(), L.chunk_square()
  normed = (L.shape(q.dtype, B, Tp, H, Dk), L.shape(k.dtype, B, Tp, H, Dk)) if normalize else ()
  summed = (L.shape(F32, B, Tp, H, Dk),) if from_gates else ()
  outputs = (L.shape(cd, B, Tp, H, Dk),) * 3 + (L.shape(
      F32, B, H, n, C, C), L.shape(cd, B, H, n, C, C), L.shape(jnp.int32, B, H, n, C))
  kernel = functools.partial(_first_pass_kernel, keys_of_halves=keys_of_halves,
                             keep_normalized=keep_normalized, normalize=normalize,
                             from_gates=from_gates, interpret=interpret, operand=operand,
                             halves_normalize=halves_normalize,
                             chunk_ends=chunk_ends_asked(summed_rows, from_gates))
  extra = normed + summed
  qg, kg, kw, a_kk, a_qk, layouts, *extra = L.call(
      kernel, (B, H, n), [keys, keys, keys, L.chunk_beta(), flag, flag, flag],
      (keys, keys, keys, square, square, L.chunk_layout_flag()) + (keys,) * len(extra),
      outputs + extra, name="kda_chunk_scores_whole_chunk", interpret=interpret, num_warps=warps,
      num_stages=2)(q, k, b, beta, runs, carry_in, in_last)
  if from_gates:
    *extra, b = extra
  return (qg, kg, kw, a_kk, a_qk, layouts, *(extra or (q, k)), b)


def _later_pass(layout, q, k, b, beta, runs, layouts, a_kk, a_qk, *, cd, interpret, num_warps,
                operand, normalize=False):
  """(A_kk, A_qk) with the chunks of `layout` (HALVES or SUB_CHUNKS) formed in place
    (_later_pass_kernel; normalize: HALVES from q and k unnormalised)."""
  B, Tp, H, Dk = k.shape
  keys, square = L.chunk_rows(Dk), L.chunk_square()
  inputs = [keys, keys, keys, L.chunk_beta(), L.chunk_flags(), L.chunk_layout_flag()]
  name = {factors.HALVES: "halves", factors.SUB_CHUNKS: "sub_chunks"}[layout]
  shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (a_kk, a_qk))
  aliases = {len(inputs): 0, len(inputs) + 1: 1}
  kernel = functools.partial(_later_pass_kernel, layout=layout, cd=cd, operand=operand,
                             normalize=normalize)
  call = L.call(kernel, (B, H, Tp // C), inputs + [square, square], (square, square), shapes,
                name=f"kda_chunk_scores_{name}", input_output_aliases=aliases, interpret=interpret,
                num_warps=num_warps, num_stages=2)
  return if_any_chunk(layouts, layout, lambda *a: call(q, k, b, beta, runs, layouts, *a), a_kk,
                      a_qk)


# A later pass launched only where a chunk takes its layout (lax.cond on the layout flags):
# its programs otherwise each read a flag and end, 31-41 us a kernel at the goal shapes,
# where the condition costs a reduction over the flags and a conditional
# (docs/performance.md, "Later passes skipped where no chunk takes their layout")
SKIP_ABSENT_LAYOUTS = True


def if_any_chunk(layouts, layout, run, *outputs):
  """run(*outputs) where some chunk's flag (layouts [B, H, n, C], _chunk_factors.
    record_layout) is `layout`, else the outputs unchanged; with SKIP_ABSENT_LAYOUTS off,
    run(*outputs) always."""
  if not SKIP_ABSENT_LAYOUTS:
    return run(*outputs)
  present = jnp.any(layouts[..., 0] == layout)
  return jax.lax.cond(present, run, lambda *a: a, *outputs)


def _halves_first_pass(q, k, b, beta, runs, carry_in, in_last, layouts, *, cd, interpret, num_warps,
                       operand):
  """(qg, kg, kw, A_kk, A_qk) of q and k normalised, by the HALVES-first form
    (HALVES_ROWS_IN_THEIR_KERNEL): the layouts as given (None: from b in XLA), then
    _halves_first_kernel (num_warps), _whole_chunks_kernel where a chunk is WHOLE_CHUNK and
    the SUB_CHUNKS kernel where one is SUB_CHUNKS, each into the first one's outputs; with
    WHOLE_CHUNKS_ALONE, where every chunk is WHOLE_CHUNK, _whole_chunks_kernel alone."""
  B, Tp, H, Dk = k.shape
  n = Tp // C
  keys, flag, square = L.chunk_rows(Dk), L.chunk_flags(), L.chunk_square()
  layouts = factors.score_layout_flags(b) if layouts is None else layouts
  inputs = [keys, keys, keys, L.chunk_beta(), flag, flag, flag, L.chunk_layout_flag()]
  specs = (keys,) * 3 + (square,) * 2
  shapes = (L.shape(cd, B, Tp, H, Dk),) * 3 + (L.shape(F32, B, H, n, C,
                                                       C), L.shape(cd, B, H, n, C, C))
  args = (q, k, b, beta, runs, carry_in, in_last, layouts)
  whole_kernel = functools.partial(_whole_chunks_kernel, operand=operand)
  launch = dict(name="kda_chunk_scores_whole_chunk_given", interpret=interpret,
                num_warps=NORMALIZING_WARPS, num_stages=2)
  whole = L.call(whole_kernel, (B, H, n), inputs + list(specs), specs, shapes,
                 input_output_aliases={len(inputs) + i: i for i in range(len(specs))}, **launch)

  def halves_first():
    *written, nq, nk = L.call(
        functools.partial(_halves_first_kernel,
                          operand=operand), (B, H, n), inputs, specs + (keys, keys),
        shapes + (L.shape(q.dtype, B, Tp, H, Dk), L.shape(k.dtype, B, Tp, H, Dk)),
        name="kda_chunk_scores_halves_first", interpret=interpret, num_warps=num_warps,
        num_stages=2)(*args)
    qg, kg, kw, a_kk, a_qk = if_any_chunk(layouts, factors.WHOLE_CHUNK, lambda *w: whole(*args, *w),
                                          *written)
    a_kk, a_qk = _later_pass(factors.SUB_CHUNKS, nq, nk, b, beta, runs, layouts, a_kk, a_qk, cd=cd,
                             interpret=interpret, num_warps=num_warps, operand=operand)
    return qg, kg, kw, a_kk, a_qk

  if not WHOLE_CHUNKS_ALONE:
    return halves_first()
  whole_alone = L.call(whole_kernel, (B, H, n), inputs, specs, shapes, **launch)
  every_chunk_whole = jnp.all(layouts[..., 0] == factors.WHOLE_CHUNK)
  return jax.lax.cond(every_chunk_whole, lambda: tuple(whole_alone(*args)), halves_first)


def chunk_scores(q, k, b, beta, runs, carry_in, in_last, *, cd, interpret, num_warps=4,
                 form="one_kernel", factored_warps=None, normalize=False, keep_normalized=True,
                 from_gates=False, operands="compute", summed_rows="all", layouts=None):
  """(qg, kg, kw = beta k exp(b) carry_in [B, Tp, H, Dk] in cd, A_kk [B, H, n, C, C] fp32,
    A_qk [B, H, n, C, C] in cd), all of it, with `normalize`, of q and k L2-normalised per
    token: the first kernel scales its products and rows by the inverse norms and writes the
    normalised rows (in q's and k's dtypes) that the SUB_CHUNKS kernel reads, the HALVES one
    normalising its own (form="by_layout"); with keep_normalized it writes them for every
    chunk, the HALVES kernel reads them, and they follow the outputs (what the backward
    reads). b: the in-chunk cumulative log decay, or with
    from_gates the log decays g themselves, which the first kernel sums (by_layout too); b
    then comes last, its rows as summed_rows says (_pallas_common.SUMMED_ROWS).

    form (_chunk_factors.SCORE_KERNELS): one kernel that branches per chunk (num_warps);
    by_layout, three kernels, the WHOLE_CHUNK chunks' (factored_warps; None:
    _first_pass_warps), then the HALVES ones' and the SUB_CHUNKS ones' (num_warps); with
    `normalize` and not keep_normalized (the forward alone) and b given summed, by
    HALVES_ROWS_IN_THEIR_KERNEL, the HALVES-first form: the HALVES chunks' kernel first,
    writing their qg, kg and kw too, the WHOLE_CHUNK chunks' after it. layouts: every
    chunk's layout [B, H, n, C] for that form (_chunk_cumsum.chunk_cumsum_and_layouts'; None: from b in XLA).
    operands: the factored products' operand dtype, one of _chunk_factors.SCORE_OPERANDS."""
  if form not in factors.SCORE_KERNELS:
    raise ValueError(f"form = {form!r}: expected one of {list(factors.SCORE_KERNELS)}")
  chunk_ends_asked(summed_rows, from_gates)
  for name, asked in (("normalize", normalize), ("from_gates", from_gates)):
    if asked and form not in FIRST_KERNEL_FORMS:
      raise ValueError(
          f"chunk_scores({name}=True) needs a form of {list(FIRST_KERNEL_FORMS)}, not {form!r}")
  if HALVES_ROWS_IN_THEIR_KERNEL not in HALVES_ROWS_FORMS:
    raise ValueError(f"HALVES_ROWS_IN_THEIR_KERNEL = {HALVES_ROWS_IN_THEIR_KERNEL!r}: expected "
                     f"one of {list(HALVES_ROWS_FORMS)}")
  operand = factors.operand_dtype(operands, cd)
  B, Tp, H, Dk = k.shape
  n = Tp // C
  keys, flag, square = L.chunk_rows(Dk), L.chunk_flags(), L.chunk_square()
  outputs = (L.shape(cd, B, Tp, H, Dk),) * 3 + (L.shape(F32, B, H, n, C,
                                                        C), L.shape(cd, B, H, n, C, C))
  inputs = [keys, keys, keys, L.chunk_beta(), flag, flag, flag]
  # two stages keep the sub-chunk path's loads over earlier sub-chunks in flight
  launch = dict(interpret=interpret, num_warps=num_warps, num_stages=2)
  if form == "one_kernel":
    return L.call(functools.partial(_scores_kernel, cd=cd, operand=operand), (B, H, n), inputs,
                  (keys, keys, keys, square, square), outputs, name="kda_chunk_scores",
                  **launch)(q, k, b, beta, runs, carry_in, in_last)
  # Unless the normalised rows are kept, the HALVES kernel normalises its own from q and k as
  # given: no normalised rows written for its chunks (docs/performance.md, "The HALVES
  # kernel normalising its own rows")
  halves_normalize = normalize and not keep_normalized
  if halves_normalize and not from_gates and HALVES_ROWS_IN_THEIR_KERNEL == "halves_first":
    return _halves_first_pass(q, k, b, beta, runs, carry_in, in_last, layouts, cd=cd,
                              interpret=interpret, num_warps=HALVES_WARPS or num_warps,
                              operand=operand)
  raw = q, k
  qg, kg, kw, a_kk, a_qk, flags, q, k, b = _first_pass(
      q, k, b, beta, runs, carry_in, in_last, cd=cd, interpret=interpret,
      warps=_first_pass_warps(factored_warps, normalize), normalize=normalize, keys_of_halves=True,
      keep_normalized=keep_normalized, from_gates=from_gates, operand=operand,
      halves_normalize=halves_normalize, summed_rows=summed_rows)
  halves_rows = raw if halves_normalize else (q, k)
  a_kk, a_qk = _later_pass(factors.HALVES, *halves_rows, b, beta, runs, flags, a_kk, a_qk, cd=cd,
                           interpret=interpret, num_warps=HALVES_WARPS or num_warps,
                           operand=operand, normalize=halves_normalize)
  a_kk, a_qk = _later_pass(factors.SUB_CHUNKS, q, k, b, beta, runs, flags, a_kk, a_qk, cd=cd,
                           interpret=interpret, num_warps=num_warps, operand=operand)
  return (qg, kg, kw, a_kk, a_qk) + ((q, k) if normalize and keep_normalized else
                                     ()) + ((b,) if from_gates else ())


def chunk_scores_and_solve(q, k, v, b, beta, runs, carry_in, in_last, *, cd, interpret,
                           emit_inverse, normalize=False, num_warps=4, factored_warps=None,
                           solve_warps=4, keep_normalized=True, from_gates=False,
                           operands="compute", inverse="by_halves", summed_rows="all"):
  """The scores by layout with the HALVES chunks solved in place (_kda_intra's chunk form):
    (qg, kg, w [B, Tp, H, Dk], u0 [B, Tp, H, Dv], A_qk [B, H, n, C, C], all in cd,
    T [B, H, n, C, C] in cd when emit_inverse), of q and k L2-normalised with `normalize`,
    as chunk_scores normalises them (keep_normalized: the normalised q, k follow; from_gates:
    b is the log decays, summed in the first kernel, and comes last, its rows as
    summed_rows says; operands: as chunk_scores takes them; inverse: how the solve's kernel
    forms T, _kda_solve.INVERSES).

    Four kernels: chunk_scores(form="by_layout")'s first (factored_warps; kw of every chunk
    but the HALVES ones), its HALVES one, which also solves its chunks (num_warps), and its
    SUB_CHUNKS one (num_warps); then the solve's kernel for the chunks not HALVES
    (solve_warps), into the HALVES kernel's w, u0 (and T) (input_output_aliases)."""
  operand = factors.operand_dtype(operands, cd)
  B, Tp, H, Dk = k.shape
  Dv = v.shape[-1]
  n = Tp // C
  keys, values, flag, square = L.chunk_rows(Dk), L.chunk_rows(Dv), L.chunk_flags(), L.chunk_square()
  layout, beta_spec = L.chunk_layout_flag(), L.chunk_beta()
  solved_specs = (keys, values) + ((square,) if emit_inverse else ())
  solved_shapes = (L.shape(cd, B, Tp, H, Dk), L.shape(cd, B, Tp, H, Dv)) + (
      (L.shape(cd, B, H, n, C, C),) if emit_inverse else ())
  qg, kg, kw, a_kk, a_qk, layouts, q, k, b = _first_pass(
      q, k, b, beta, runs, carry_in, in_last, cd=cd, interpret=interpret,
      warps=_first_pass_warps(factored_warps, normalize), normalize=normalize, keys_of_halves=False,
      keep_normalized=keep_normalized, from_gates=from_gates, operand=operand,
      summed_rows=summed_rows)
  a_qk, *solved = L.call(
      functools.partial(_halves_solving_kernel, cd=cd, interpret=interpret, operand=operand),
      (B, H, n), [keys, keys, keys, beta_spec, flag, flag, values, layout, square],
      (square,) + solved_specs, (L.shape(cd, B, H, n, C, C),) + solved_shapes,
      name="kda_chunk_scores_solve_halves", input_output_aliases={8: 0}, interpret=interpret,
      num_warps=num_warps, num_stages=2)(q, k, b, beta, runs, carry_in, v, layouts, a_qk)
  a_kk, a_qk = _later_pass(factors.SUB_CHUNKS, q, k, b, beta, runs, layouts, a_kk, a_qk, cd=cd,
                           interpret=interpret, num_warps=num_warps, operand=operand)
  ins = [layout, square, keys, values, beta_spec]
  solved = L.call(
      functools.partial(solve_unless_kernel, layout=factors.HALVES, cd=cd, interpret=interpret,
                        inverse=inverse), (B, H, n), ins + list(solved_specs), solved_specs,
      solved_shapes, name="kda_chunk_solve_unless_halves",
      input_output_aliases={len(ins) + i: i for i in range(len(solved_specs))}, interpret=interpret,
      num_warps=solve_warps)(layouts, a_kk, kw, v, beta, *solved)
  return (qg, kg, solved[0], solved[1], a_qk, *solved[2:]) + (
      (q, k) if normalize and keep_normalized else ()) + ((b,) if from_gates else ())

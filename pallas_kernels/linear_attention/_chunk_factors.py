"""In-chunk decay factoring through per-channel anchors, for chunks whose decays allow.

For any per-channel anchor m, sum_d x_t[d] y_s[d] exp(b_t[d] - b_s[d]) equals
(x_t exp(b_t - m)) . (y_s exp(m - b_s)), so an in-chunk decayed product (the scores A,
the score-gradient paths into dq and dk) is a matmul of fp32 operands (TF32 on GPU, exact
in interpret mode) instead of 16-token sub-chunk blocks and exact diagonal blocks. Every
factor must stay far from fp32 overflow and underflow: within exp(+-WHOLE_LIMIT) over a
whole chunk, exp(+-HALF_LIMIT) in a half, exp(+-FACTOR_LIMIT) in a sub-chunk.

A chunk takes one of these layouts (the scores' kernels take WHOLE_CHUNK, HALVES or
SUB_CHUNKS; the key gradients' WHOLE_CHUNK, PER_SUB_CHUNK or SUB_CHUNKS):
  WHOLE_CHUNK     one anchor, the midpoint of the chunk's range of b in each channel: every
                  channel decays by at most 2 * WHOLE_LIMIT over the 64 tokens (a gate
                  above -1.9 a token on average, which covers the KDA layer's gates at
                  their initialisation); one [64, D] matmul per product.
  HALVES          each 32-token half anchored at its 16th token, every token within
                  HALF_LIMIT of its half's anchor (a gate above -5 a token on average over
                  any 16 tokens, which covers gates bounded below by -5), and the second
                  half's anchor within HALF_LIMIT of the first half's last token: one
                  [64, D] matmul per product gives the pairs inside a half; the pairs
                  across the halves come from a second one with both sides anchored at
                  the first half's last token, where no factor exceeds 1 whatever the
                  decay.
  PER_SUB_CHUNK   one anchor m_J per 16-token sub-chunk J, the midpoint of its range: every
                  sub-chunk decays by at most 2 * FACTOR_LIMIT (a gate above -5.3 a token
                  on average, which covers gates bounded below by -5). Every token is
                  factored through its own sub-chunk's anchor, and a pair (t in I, s in
                  J <= I) is bridged by exp(m_I - m_J) <= 1, applied to one side's
                  operand (`Anchors`): one matmul per sub-chunk and product, and no more
                  exps than WHOLE_CHUNK.
  SUB_CHUNKS      anything else: 16-token sub-chunk blocks whose exponents are all <= 0
                  and exact diagonal blocks (_score_rows, _diagonal_blocks).
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention._diagonal_blocks import FACTOR_LIMIT
from pallas_kernels.linear_attention._pallas_common import F32, N_SUB, SUB, iota, mm, rows

WHOLE_CHUNK, PER_SUB_CHUNK, SUB_CHUNKS, HALVES = 0, 1, 2, 3
C = N_SUB * SUB
BRIDGE_SHIFT = FACTOR_LIMIT / 2  # see Anchors
HALF = C // 2
HALF_ANCHOR = SUB - 1  # a half's anchor: its 16th token (15 tokens before it, 16 after)
# Factors of the HALVES layout are within exp(+-HALF_LIMIT), far from fp32 overflow for
# inputs of any sensible size (exp(80) |x| overflows only past |x| ~ 6e3)
HALF_LIMIT = 2.0 * FACTOR_LIMIT
# Factors of the WHOLE_CHUNK layout are within exp(+-WHOLE_LIMIT) = 1.1e26: an operand
# overflows only past |x| ~ 3e12, and a kept pair's smaller factor times x stays a normal
# fp32 number down to |x| ~ 1e-12. Only the pairs the causal mask drops can overflow
# (exp(2 WHOLE_LIMIT)), and every store masks them.
WHOLE_LIMIT = 60.0


def midpoint(b, start=0, n=C):
  """(m [1, D], bounded): the per-channel midpoint of rows [start, start + n) of b [T, D] (a
    ref or an array) and whether they may factor their decays through it: within
    exp(+-WHOLE_LIMIT) over the whole chunk, exp(+-FACTOR_LIMIT) over a sub-chunk. Log
    decays g <= 0 make b fall in every channel, so a span's range is the gap between its end
    rows: two rows read, not n (a kernel's code stays small: docs/kernel_tuning.md, "Code
    size")."""
  first = b[start:start + 1, :].astype(jnp.float32)
  last = b[start + n - 1:start + n, :].astype(jnp.float32)
  return 0.5 * (first + last), jnp.max(first - last) <= 2.0 * _limit(n)


def _limit(n):
  """The factor limit of an n-token span: WHOLE_LIMIT for a chunk, else FACTOR_LIMIT."""
  return WHOLE_LIMIT if n == C else FACTOR_LIMIT


def rows_midpoint(b):
  """midpoint's (m, bounded) of loaded rows b [n, D], by reductions in registers: where a
    kernel holds the rows anyway, the end rows' loads would add layout conversions (and
    spills, in the scores' first kernels: experiments/kernel_resources.py)."""
  hi, lo = jnp.max(b, axis=0, keepdims=True), jnp.min(b, axis=0, keepdims=True)
  return 0.5 * (hi + lo), jnp.max(hi - lo) <= 2.0 * _limit(b.shape[0])


def factors(b, m):
  """(exp(b - m), exp(m - b)): the query-side and key-side factors of every token."""
  rel = b - m
  return jnp.exp(rel), jnp.exp(-rel)


def _per_token(values):
  """[C, D] whose row t is values[t // SUB] (N_SUB rows [1, D])."""
  sub_chunk = iota(C, 0, (C, 1)) // SUB
  out = values[-1]
  for j in range(N_SUB - 2, -1, -1):
    out = jnp.where(sub_chunk == j, values[j], out)
  return out


class Anchors(NamedTuple):
  """A factored chunk's anchors: one [1, D] row per sub-chunk (all the chunk's midpoint when
    `uniform`, the WHOLE_CHUNK layout). `uniform` is traced where one kernel takes both
    layouts, or a Python bool where a kernel takes one: then only that layout's code is
    compiled.

    Per sub-chunk, a loop step over sub-chunk i pairs its own rows, factored by
    `step_factors`, with operands of the whole chunk (every row factored through its own
    anchor) bridged to m_i. The step's factors carry exp(-BRIDGE_SHIFT) and the bridges
    exp(+BRIDGE_SHIFT), so that a bridge flushes to zero (below exp(-87)) only for pairs
    whose decay is below exp(2 FACTOR_LIMIT - BRIDGE_SHIFT - 87) ~ 2e-12, where an
    unshifted one could drop pairs that decay by as little as exp(2 FACTOR_LIMIT - 87) ~
    7e-4 (two 80-wide sub-chunks across a one-token gap). Bridged operands stay within
    exp(FACTOR_LIMIT + BRIDGE_SHIFT) times their inputs (finite where a dropped pair
    multiplies them by zero)."""
  rows: tuple
  uniform: jax.Array

  def per_token(self):
    """[C, D]: every token's anchor."""
    return self.rows[0] if self.uniform is True else _per_token(self.rows)

  def of(self, i):
    """[1, D]: the anchor of sub-chunk i (a loop index)."""
    if self.uniform is True:
      return self.rows[0]
    out = self.rows[0]
    for j in range(1, N_SUB):
      out = jnp.where(i == j, self.rows[j], out)
    return out

  def step_factors(self, b_i, i):
    """(exp(b - m_i), exp(m_i - b)) for sub-chunk i's rows b_i [SUB, D], each times
      exp(-BRIDGE_SHIFT) unless uniform (the bridges carry it back)."""
    shift = BRIDGE_SHIFT * (1.0 - jnp.asarray(self.uniform, jnp.float32))
    rel = b_i - self.of(i)
    return jnp.exp(rel - shift), jnp.exp(-rel - shift)

  def bridge(self, x, i, keys):
    """x [C, D], every row factored through its own anchor, re-anchored at sub-chunk i's
      m_i for the pairs the causal mask keeps: as keys (rows of sub-chunks J <= i) times
      exp(m_i - m_J), as queries (rows of sub-chunks J >= i) times exp(m_J - m_i); each
      times exp(BRIDGE_SHIFT) (see step_factors). Other rows get exp(BRIDGE_SHIFT) alone
      (finite; their pairs are dropped). Skipped when uniform."""
    m_i = self.of(i)

    def bridged():
      rel = [(m_i - m_j) if keys else (m_j - m_i) for m_j in self.rows]
      return x * _per_token([jnp.exp(jnp.minimum(r, 0.0) + BRIDGE_SHIFT) for r in rel])

    if isinstance(self.uniform, bool):
      return x if self.uniform else bridged()
    return jax.lax.cond(self.uniform, lambda: x, bridged)


def row_of(b, r):
  """Row r of rows b [n, D] held in registers, as [1, D] (a masked sum: no load)."""
  return jnp.sum(jnp.where(iota(b.shape[0], 0, (b.shape[0], 1)) == r, b, 0.0), axis=0,
                 keepdims=True)


def halves_bounded_rows(b):
  """halves_bounded for a chunk's rows b [C, D] held in registers: every token's gap to its
    half's anchor, taken from the rows (score_layouts' test)."""
  first = iota(C, 0, (C, 1)) < HALF
  second_anchor = row_of(b, HALF + HALF_ANCHOR)
  anchor = jnp.where(first, row_of(b, HALF_ANCHOR), second_anchor)
  edge_gap = jnp.max(jnp.abs(row_of(b, HALF - 1) - second_anchor))
  return jnp.maximum(jnp.max(jnp.abs(b - anchor)), edge_gap) <= HALF_LIMIT


def halves_bounded(b_ref):
  """Whether every token of the chunk (b_ref [C, D]) is within HALF_LIMIT of its half's
    anchor in every channel, and the second half's anchor within HALF_LIMIT of the first
    half's last token (the pairs across re-anchor there: halves_products): the HALVES
    layout. With b falling in every channel (midpoint), a half's widest gap is at one of its
    ends."""
  second_anchor = rows(b_ref, HALF + HALF_ANCHOR, 1)
  gap = jnp.abs(rows(b_ref, HALF - 1, 1) - second_anchor)
  for start in (0, HALF):
    anchor = rows(b_ref, start + HALF_ANCHOR, 1)
    widest = jnp.maximum(rows(b_ref, start, 1) - anchor, anchor - rows(b_ref, start + HALF - 1, 1))
    gap = jnp.maximum(gap, widest)
  return jnp.max(gap) <= HALF_LIMIT


# The scores' decayed products sum_d x_t[d] k_s[d] exp(b_t[d] - b_s[d]) of a chunk, for each
# query-side x, by columns: store(col, region, *products) with products [C, n] for columns
# [col, col + n) and region the entries to write (None: all); each is meaningful on the
# pairs s <= t only (the rest may be inf: the caller masks them). dtypes: each product's
# operand dtype (fp32 products run as TF32 on the GPU); None: fp32 for all.


def whole_chunk_products(k, b, queries, store, dtypes=None):
  """WHOLE_CHUNK: one [C, D] x [D, C] product per query (k and queries: loaders of the
    chunk's [C, D] fp32 rows, called at each use; b: its rows of b, loaded)."""
  down, up = factors(b, rows_midpoint(b)[0])
  keys = k() * up
  dtypes = dtypes or (F32,) * len(queries)
  store(0, None, *(mm(x() * down, keys, dtype, trans_b=True) for x, dtype in zip(queries, dtypes)))


class HeldRows(NamedTuple):
  """halves_products' b as the chunk's rows [C, D] held in registers (split into its channel
    blocks there): no kernel writes b's rows for the HALVES path to read back."""
  b: jax.Array


# How halves_products forms the pairs across the halves: "bridged" from the inside's
# operands, each side re-anchored at the first half's last token by one row of factors (no
# exp of its own, one load of the rows; needs the second half's anchor within HALF_LIMIT of
# that token, which halves_bounded checks; holds both products' sums at once); "own_exp",
# from one more exp over the chunk's rows of b, loaded again
HALVES_ACROSS_FORMS = ("bridged", "own_exp")


def halves_products(k_ref, b_ref, query_refs, store, block_d=None, dtypes=None, across="own_exp"):
  """HALVES: per query a [C, D] x [D, C] product for the pairs inside each half and one for
    those across (k_ref and query_refs: the chunk's [C, D] refs; b_ref: the ref of its b, or
    HeldRows): two stores, each [C, C], the first over the pairs inside, the second over
    those across. block_d: the channels taken at a time, each block's products summed
    (fewer operands live at once than the whole width's); None: all D at once. across: one
    of HALVES_ACROSS_FORMS."""
  if across not in HALVES_ACROSS_FORMS:
    raise ValueError(f"across = {across!r}: expected one of {HALVES_ACROSS_FORMS}")
  D = k_ref.shape[-1]
  block_d = min(block_d or D, D)
  dtypes = dtypes or (F32,) * len(query_refs)
  first = iota(C, 0, (C, 1)) < HALF
  inside_region = first | (iota(C, 1, (C, C)) >= HALF)
  across_region = jnp.logical_not(first) & (iota(C, 1, (C, C)) < HALF)
  # per block, a loader of rows [start, start + n) of a ref's block_d channels (fp32)
  blocks = [rows] if block_d == D else [
      (lambda ref, start, n, d=d: ref[pl.ds(start, n), pl.ds(d, block_d)].astype(jnp.float32))
      for d in range(0, D, block_d)
  ]
  if isinstance(b_ref, HeldRows):
    held = jnp.split(b_ref.b, len(blocks), axis=1) if len(blocks) > 1 else [b_ref.b]

  def summed(load, i):
    """(b's rows of block i [C, n], which `load` reads; row(r) -> its row r [1, n])."""
    if isinstance(b_ref, HeldRows):
      return held[i], lambda r: row_of(held[i], r)
    return load(b_ref, 0, C), lambda r: load(b_ref, r, 1)

  def add(sums, parts):
    return parts if sums is None else [a + p for a, p in zip(sums, parts)]

  def products(load, down, keys):
    return [
        mm(load(x, 0, C) * down, keys, dtype, trans_b=True) for x, dtype in zip(query_refs, dtypes)
    ]

  def inside(load, i):
    """(query-side factors, keys) of block i through each half's anchor, and b's row(r)."""
    b, row = summed(load, i)
    down, up = factors(b, jnp.where(first, row(HALF_ANCHOR), row(HALF + HALF_ANCHOR)))
    return down, load(k_ref, 0, C) * up, row

  if across == "bridged":
    # the pairs across from the inside's operands: a query of the second half times
    # exp(m_2 - edge), a key of the first times exp(edge - m_1) (m_h: the halves' anchors,
    # edge: the first half's last token), both rows <= 1 and >= exp(-HALF_LIMIT), so that
    # the products are the pairs' factors through the edge, each <= 1
    inside_sums = across_sums = None
    for i, load in enumerate(blocks):
      down, keys, row = inside(load, i)
      edge = row(HALF - 1)
      inside_sums = add(inside_sums, products(load, down, keys))
      across_sums = add(
          across_sums,
          products(load, down * jnp.exp(row(HALF + HALF_ANCHOR) - edge),
                   keys * jnp.exp(edge - row(HALF_ANCHOR))))
    store(0, inside_region, *inside_sums)
    store(0, across_region, *across_sums)
    return

  def across(load, i):
    # queries of the second half and keys of the first, both through the first half's last
    # token: the keys' rows and the queries' are the two halves, so one exp over the chunk
    # gives both factors, every exponent <= 0 (docs/performance.md, "The HALVES kernel
    # normalising its own rows")
    b, row = summed(load, i)
    edge = row(HALF - 1)
    to_edge = jnp.exp(jnp.where(first, edge - b, b - edge))
    return jnp.where(first, 0.0, to_edge), jnp.where(first, load(k_ref, 0, C) * to_edge, 0.0)

  def inside_operands(load, i):
    return inside(load, i)[:2]

  for region, operands in ((inside_region, inside_operands), (across_region, across)):
    sums = None
    for i, load in enumerate(blocks):
      sums = add(sums, products(load, *operands(load, i)))
    store(0, region, *sums)


def anchors(b_ref):
  """(Anchors, factors): the anchors of the chunk's layout, from its b_ref [C, D], and
    whether it factors at all (WHOLE_CHUNK or PER_SUB_CHUNK)."""
  m, whole = midpoint(b_ref)
  own, per_sub_chunk = sub_chunk_anchors(b_ref)
  return Anchors(tuple(jnp.where(whole, m, m_j) for m_j in own.rows), whole), whole | per_sub_chunk


def whole_chunk_anchors(b_ref):
  """(Anchors, whole): the chunk's one anchor (uniform, statically) and whether its decays
    factor through it (WHOLE_CHUNK)."""
  m, whole = midpoint(b_ref)
  return Anchors((m,) * N_SUB, True), whole


def sub_chunk_anchors(b_ref, from_rows=False):
  """(Anchors, bounded): one anchor per sub-chunk (not uniform, statically) and whether
    every sub-chunk's decays factor through its own (PER_SUB_CHUNK, or WHOLE_CHUNK too);
    from_rows: by rows_midpoint over every row (else midpoint's end rows)."""
  own, bounded = zip(
      *(rows_midpoint(rows(b_ref, j * SUB, SUB)) if from_rows else midpoint(b_ref, j * SUB, SUB)
        for j in range(N_SUB)))
  every = bounded[0]
  for each in bounded[1:]:
    every &= each
  return Anchors(own, False), every


# The two-pass key-gradient kernels (chunk_key_grads(by_layout=True)): each program of
# either pass decides from its own block of b whether its chunk has one anchor, so the
# passes agree without a flag. compute(layout) runs the chunk, with layout() giving its
# (anchors, factored_ok).


def factored_or(factored_ok, factored, others):
  """factored() where the chunk factors, else others(); factored_ok statically True (a
    first pass's chunk) compiles factored() alone."""
  if factored_ok is True:
    factored()
  else:
    jax.lax.cond(factored_ok, factored, others)


def if_whole_chunk(b_ref, compute):
  """compute() for a chunk whose decays factor over one anchor, with only that path
    compiled; else nothing."""
  anchors, whole = whole_chunk_anchors(b_ref)
  jax.lax.cond(whole, lambda: compute(lambda: (anchors, True)), lambda: None)


def unless_whole_chunk(b_ref, compute):
  """The second pass: compute() for the chunks the first left, anchored per sub-chunk
    where their decays allow, else by sub-chunk blocks. Its test and anchors come from
    every row (rows_midpoint): from the end rows, KDA's second key-gradient kernel spilled
    more and its forward+backward with strong gates took 2% longer than with every row
    (docs/performance.md, "Layouts from the chunk's end rows")."""
  whole = rows_midpoint(rows(b_ref, 0, C))[1]
  jax.lax.cond(whole, lambda: None,
               lambda: compute(lambda: sub_chunk_anchors(b_ref, from_rows=True)))


# The forms of the scores' kernels (chunk_scores(form=...)), the GLA and KDA ops' choice:
#   one_kernel        one kernel that branches per chunk on its layout;
#   by_layout         the first kernel forms the WHOLE_CHUNK chunks' scores and records
#                     every chunk's layout in a [C] int32 block; a second forms the HALVES
#                     chunks', a third the SUB_CHUNKS ones', each into the first one's
#                     output (input_output_aliases) and compiled with its own path alone
#                     (one kernel holding two or three of them spills more:
#                     experiments/kernel_resources.py). The flags' codes are int32
#                     (_code): as weak literals they lowered to 0 or 1 on the GPU, and
#                     the later kernels skipped their chunks (docs/performance.md).
SCORE_KERNELS = ("one_kernel", "by_layout")
# The scores' SUB_CHUNKS chunks' kernel first, then one for the others (sub_chunks_first),
# and the key gradients' forms other_chunks_first (the same pattern) and by_layout_one_loop
# (the second kernel's two loops as one) were measured no faster than by_layout and removed
# (docs/performance.md, "The HALVES chunks in the first scores kernel"); so was
# factored_first, by_layout's first kernel forming the HALVES chunks' scores too (a kernel
# holding both factored paths, past the instruction cache: docs/performance.md, "The L2
# norm as row scales; the decays summed in the scores kernel").
# The forms of the key gradients' kernels (KDA: _kda_key_grads.chunk_key_grads(form=...);
# GLA: _gla_chunks.chunk_key_grads(by_layout=...)): one kernel branching per chunk, or the
# whole-chunk-anchored chunks' kernel, then the others' into its outputs (by_layout, the
# scores' by_layout pattern).
KEY_GRAD_KERNELS = ("one_kernel", "by_layout")

# The operand dtype of the factored layouts' score products (WHOLE_CHUNK, HALVES), the GLA
# and KDA ops' score_operands: "fp32" (TF32 on the GPU) or "compute", the compute dtype
# (bf16 for bf16 inputs), as the SUB_CHUNKS blocks below the diagonal take it. KDA's A_kk
# takes it too: its sum is still fp32 and stored so (docs/performance.md, "Score products
# on bf16 operands").
SCORE_OPERANDS = ("fp32", "compute")


def operand_dtype(choice, cd):
  """The score products' operand dtype for a SCORE_OPERANDS choice and compute dtype cd."""
  if choice not in SCORE_OPERANDS:
    raise ValueError(f"score_operands = {choice!r}: expected one of {list(SCORE_OPERANDS)}")
  return cd if choice == "compute" else F32


def by_score_layout(b_ref, whole_chunk, halves, sub_chunks):
  """whole_chunk(), halves() or sub_chunks() by the chunk's layout for the scores
    (WHOLE_CHUNK, HALVES, SUB_CHUNKS)."""
  jax.lax.cond(
      midpoint(b_ref)[1], whole_chunk,
      lambda: jax.lax.cond(halves_bounded(b_ref), halves, sub_chunks))


# The layout from rows held in registers, for a kernel that writes b_ref only where a path
# reads its rows back (_pallas_common.SUMMED_ROWS' chunk_ends): WHOLE_CHUNK by rows_midpoint
# (for a falling b, midpoint's test), HALVES by halves_bounded_rows, b_ref written by
# write_rows() where a path reads its rows back from memory (the SUB_CHUNKS path; KDA's
# HALVES kernel too).


def by_score_layout_from_rows(b, b_ref, write_rows, whole_chunk, halves, sub_chunks):
  """by_score_layout for a chunk's rows b [C, D] in registers, b_ref written by
    write_rows() for the SUB_CHUNKS chunks alone: halves() takes the rows as held
    (HeldRows) or writes them itself."""

  def by_sub_chunks():
    write_rows()
    sub_chunks()

  def others():
    jax.lax.cond(halves_bounded_rows(b), halves, by_sub_chunks)

  jax.lax.cond(rows_midpoint(b)[1], whole_chunk, others)


def record_layout_from_rows(flag_ref, b, write_rows):
  """record_layout for a chunk's rows b [C, D] in registers, b's rows written by write_rows()
    for the HALVES and SUB_CHUNKS chunks alone (their kernels read them back)."""
  whole = rows_midpoint(b)[1]
  layout = jnp.where(whole, _code(WHOLE_CHUNK),
                     jnp.where(halves_bounded_rows(b), _code(HALVES), _code(SUB_CHUNKS)))
  jax.lax.cond(whole, lambda: None, write_rows)
  flag_ref[...] = jnp.full((C,), layout, jnp.int32)
  return whole, layout


def score_layout(b):
  """(whether the chunk is WHOLE_CHUNK, its layout's code for the scores: WHOLE_CHUNK, HALVES
    or SUB_CHUNKS) from its b [C, D] (a ref, or an array: score_layout_flags)."""
  whole = midpoint(b)[1]
  return whole, jnp.where(whole, _code(WHOLE_CHUNK),
                          jnp.where(halves_bounded(b), _code(HALVES), _code(SUB_CHUNKS)))


def record_layout(flag_ref, b_ref):
  """Writes the chunk's flag, its score_layout, and returns (whether it is WHOLE_CHUNK, the
    layout's code)."""
  whole, layout = score_layout(b_ref)
  flag_ref[...] = jnp.full((C,), layout, jnp.int32)
  return whole, layout


def _code(layout):
  """A layout code as an int32 scalar, not a Python int: the Triton lowering of a select
    between two Python-int literals (weakly typed) gives them the predicate's type, i1, so
    that jnp.where(p, HALVES, SUB_CHUNKS) in a kernel yields 1 or 0, not 3 or 2."""
  return jnp.int32(layout)


def if_layout(flag_ref, layout, fn, unless=False):
  """fn() for a chunk whose flag (record_layout) is `layout` (unless: is not), else nothing."""
  match = jnp.max(flag_ref[...]) == layout
  jax.lax.cond(jnp.logical_not(match) if unless else match, fn, lambda: None)


def chunk_layouts(g):
  """[B, n, H] int32: the layout each chunk of gates g [B, T, H, D] takes over all its
    channels (T a multiple of the chunk; plain JAX, for tests and reports)."""
  B, T, H, D = g.shape
  b = jnp.cumsum(g.astype(jnp.float32).reshape(B, T // C, C, H, D), axis=2)
  whole = jnp.max(b.max(axis=2) - b.min(axis=2), axis=-1) <= 2.0 * WHOLE_LIMIT
  subs = b.reshape(B, T // C, N_SUB, SUB, H, D)
  per_sub_chunk = jnp.max(subs.max(axis=3) - subs.min(axis=3), axis=(2, -1)) <= 2.0 * FACTOR_LIMIT
  return jnp.where(whole, WHOLE_CHUNK, jnp.where(per_sub_chunk, PER_SUB_CHUNK,
                                                 SUB_CHUNKS)).astype(jnp.int32)


def _per_chunk(fn, b):
  """[B, H, n]: fn of each chunk's rows [C, D] of b [B, Tp, H, D] (Tp a multiple of the
    chunk), read in place (no copy of b transposed)."""
  B, Tp, H, D = b.shape
  over_chunks = jax.vmap(jax.vmap(jax.vmap(fn), in_axes=2))  # [B, n, C, H, D]: B, then H, n
  return over_chunks(b.reshape(B, Tp // C, C, H, D))


def score_layout_flags(b):
  """[B, H, n, C] int32: each chunk's score_layout, repeated over its C entries, as
    record_layout writes it, from b [B, Tp, H, D] (the in-chunk cumulative log decay) in
    plain JAX: the six rows the kernels read, for the kernels of a call that need every
    chunk's layout before their first."""
  B, Tp, H, _ = b.shape
  layout = _per_chunk(lambda chunk: score_layout(chunk)[1], b.astype(jnp.float32))
  return jnp.broadcast_to(layout[..., None], (B, H, Tp // C, C))


def score_layouts(g):
  """[B, n, H] int32: the layout each chunk of gates g [B, T, H, D] takes in the scores'
    kernels over all its channels (WHOLE_CHUNK, HALVES or SUB_CHUNKS; T a multiple of the
    chunk; plain JAX, for tests and reports)."""
  B, T, H, D = g.shape
  b = jnp.cumsum(g.astype(jnp.float32).reshape(B, T // C, C, H, D), axis=2)
  whole = jnp.max(b.max(axis=2) - b.min(axis=2), axis=-1) <= 2.0 * WHOLE_LIMIT
  halves = b.reshape(B, T // C, 2, HALF, H, D)
  gap = jnp.max(jnp.abs(halves - halves[:, :, :, HALF_ANCHOR:HALF_ANCHOR + 1]), axis=(2, 3, -1))
  edge_gap = jnp.max(jnp.abs(halves[:, :, 0, -1] - halves[:, :, 1, HALF_ANCHOR]), axis=-1)
  bounded = jnp.maximum(gap, edge_gap) <= HALF_LIMIT
  return jnp.where(whole, WHOLE_CHUNK, jnp.where(bounded, HALVES, SUB_CHUNKS)).astype(jnp.int32)

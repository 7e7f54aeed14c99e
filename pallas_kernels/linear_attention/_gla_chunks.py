"""The parallel GLA kernels that turn the in-chunk scores into outputs and gradients.

Given the chunk's start state S (and, backward, the gradient dS of its end state) and
its scores A (_gla_scores), every chunk is independent; each kernel also splits the
channels it can, so programs stay small (few registers, many resident warps):
  outputs      o = scale (q exp(b) ci S + A v) per (chunk, block of value channels):
               two dense [64, .] matmuls;
  value grads  dv = (k exp(b_last - b) il) dS + scale A^T do per (chunk, value block);
  key grads    dq, dk and the decay gradient db per (chunk, block of key channels): one
               `fori_loop` step per 16 rows; every path into them combines channels of
               one key block only, so a block decides alone whether its decays factor
               (_chunk_factors: each step one matmul per path against the whole chunk)
               or go by sub-chunk blocks (whose diagonal blocks factor or not,
               _diagonal_blocks); one kernel branching per chunk, or two (by_layout):
               the one-anchor chunks', then the others' into the same outputs.
ci (carry_in) zeroes the start state's path for tokens past a segment reset inside the
chunk, il (in_last) the end state's path for tokens of earlier segments.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention import _chunk_factors as factors
from pallas_kernels.linear_attention import _diagonal_blocks as diag
from pallas_kernels.linear_attention._gla_layout import Grid
from pallas_kernels.linear_attention._inputs import CHUNK as C
from pallas_kernels.linear_attention._pallas_common import (F32, N_SUB, SUB, chunk_call,
                                                            compute_dtype, flag_column, iota,
                                                            masked_exp, mm, rows)


def _outputs_kernel(q_ref, b_ref, ci_ref, h_ref, a_ref, v_ref, o_ref, *, scale, cd):
  q, b = rows(q_ref, 0, C), rows(b_ref, 0, C)
  qg = q * jnp.exp(b) * flag_column(ci_ref, 0, C)
  o = mm(qg, h_ref[...], cd) + mm(a_ref[...], v_ref[...], cd)
  o_ref[...] = (scale * o).astype(o_ref.dtype)


def _value_grads_kernel(k_ref, b_ref, il_ref, ds_ref, a_ref, do_ref, dv_ref, *, scale, cd):
  k, b = rows(k_ref, 0, C), rows(b_ref, 0, C)
  kg = k * masked_exp(rows(b_ref, C - 1, 1) - b) * flag_column(il_ref, 0, C)
  dv = mm(kg, ds_ref[...], cd) + scale * mm(a_ref[...], do_ref[...], cd, trans_a=True)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _key_grads(q_ref, k_ref, v_ref, b_ref, ci_ref, il_ref, h_ref, ds_ref, do_ref, da_ref, dat_ref,
               dq_ref, dk_ref, db_ref, *, layout, scale, cd):
  """dq, dk and db of one key block, one `fori_loop` step per sub-chunk: with (anchors,
    factored_ok) = layout(), when the block's decays factor (_chunk_factors), against the
    whole chunk in one matmul per path; else by 16x16 blocks. factored_ok is traced, or
    True where only the factored steps are compiled."""
  S, dS = h_ref[...], ds_ref[...]  # matmul operands: kept in the compute dtype
  # sum_v S dS: the gradient of the start state's decay through the chunk
  hds = jnp.sum(S.astype(F32) * dS.astype(F32), axis=1)
  b = rows(b_ref, 0, C)
  b_last = rows(b_ref, C - 1, 1)
  keep = jnp.max(ci_ref[pl.ds(C - 1, 1)]).astype(F32)
  # b_last scales the surviving start state and every key's decay to the chunk end
  extra = keep * hds[None, :] * jnp.exp(b_last)
  refs = (q_ref, k_ref, v_ref, b_ref, ci_ref, il_ref, do_ref, da_ref, dat_ref, dq_ref, dk_ref,
          db_ref)

  def factored(anchors):
    """One step per sub-chunk, its rows against the whole chunk: every token factored
      through its own anchor, bridged to the step's (_chunk_factors)."""
    down, up = factors.factors(b, anchors.per_token())
    key, q_down = rows(k_ref, 0, C) * up, rows(q_ref, 0, C) * down

    def step(i, extra):
      s = pl.multiple_of(i * SUB, SUB)
      q_i, k_i, b_i = rows(q_ref, s, SUB), rows(k_ref, s, SUB), rows(b_ref, s, SUB)
      down_i, up_i = anchors.step_factors(b_i, i)
      # dq first, then dk: one of them live at a time (register pressure).
      # State path (o <- start state) and score path (dA against the keys)
      dq = (scale * mm(do_ref[pl.ds(s, SUB), :], S, cd, trans_b=True) * jnp.exp(b_i) *
            flag_column(ci_ref, s) +
            diag.f32_mm(da_ref[pl.ds(s, SUB), :], anchors.bridge(key, i, keys=True)) * down_i)
      dq_ref[pl.ds(s, SUB), :] = dq.astype(dq_ref.dtype)
      db = q_i * dq
      # state path (end state <- k, v) and score path (dA^T against the queries)
      dk = (mm(v_ref[pl.ds(s, SUB), :], dS, cd, trans_b=True) * masked_exp(b_last - b_i) *
            flag_column(il_ref, s))
      extra += jnp.sum(k_i * dk, axis=0, keepdims=True)
      dk += diag.f32_mm(dat_ref[pl.ds(s, SUB), :], anchors.bridge(q_down, i, keys=False)) * up_i
      dk_ref[pl.ds(s, SUB), :] = dk.astype(dk_ref.dtype)
      # extra is complete once the last rows have added their keys
      closes = (iota(SUB, 0, (SUB, 1)) == SUB - 1) & (i == N_SUB - 1)
      db_ref[pl.ds(s, SUB), :] = db - k_i * dk + jnp.where(closes, extra, 0.0)
      return extra

    jax.lax.fori_loop(0, N_SUB, step, extra)

  def by_sub_chunks():
    chunk = dict(q=rows(q_ref, 0, C), k=rows(k_ref, 0, C), b=b, b_last=b_last, S=S, dS=dS)
    jax.lax.fori_loop(0, N_SUB,
                      functools.partial(_sub_chunk_grads, *refs, **chunk, scale=scale, cd=cd),
                      extra)

  anchors, factored_ok = layout()
  factors.factored_or(factored_ok, lambda: factored(anchors), by_sub_chunks)


def _key_grads_kernel(*refs, **kw):
  """Every layout in one kernel, branching per chunk."""
  _key_grads(*refs, layout=lambda: factors.anchors(refs[3]), **kw)


def _whole_chunk_pass_kernel(*refs, **kw):
  """The first of two passes: the chunks whose decays factor over one anchor (in this key
    block's channels); it leaves the others' rows to the second pass."""
  factors.if_whole_chunk(refs[3], lambda layout: _key_grads(*refs, layout=layout, **kw))


def _other_chunks_pass_kernel(*refs, **kw):
  """The second pass: the chunks the first left (its outputs are the first pass's,
    aliased; the first pass's rows stay)."""
  ins, outs = refs[:11], refs[14:]  # refs[11:14]: the first pass's outputs, aliased
  factors.unless_whole_chunk(ins[3], lambda layout: _key_grads(*ins, *outs, layout=layout, **kw))


def _sub_chunk_grads(q_ref, k_ref, v_ref, b_ref, ci_ref, il_ref, do_ref, da_ref, dat_ref, dq_ref,
                     dk_ref, db_ref, i, extra, *, q, k, b, b_last, S, dS, scale, cd):
  """Sub-chunk i's rows of dq, dk, db (any decay). Score gradients are read from da_ref
    / dat_ref, so the exact diagonal blocks take one column load per step and no
    cross-thread reductions. extra: the last row's extra decay gradient, completed by
    every sub-chunk's keys. q, k, b: the whole chunk's (fp32)."""
  t_idx = iota(C)
  sub_rows = iota(SUB, 0, (SUB, 1))
  start = pl.multiple_of(i * SUB, SUB)
  q_i, k_i, b_i = (rows(x, start, SUB) for x in (q_ref, k_ref, b_ref))
  v_i, do_i = rows(v_ref, start, SUB), rows(do_ref, start, SUB)
  # state paths: o <- start state (queries), end state <- k, v (keys)
  dq_i = scale * mm(do_i, S, cd, trans_b=True) * jnp.exp(b_i) * flag_column(ci_ref, start)
  dk_i = mm(v_i, dS, cd, trans_b=True) * masked_exp(b_last - b_i) * flag_column(il_ref, start)
  extra += jnp.sum(k_i * dk_i, axis=0, keepdims=True)
  # this sub-chunk's queries against earlier keys (none for the first: all masked)
  b_edge = rows(b_ref, jnp.maximum(start - 1, 0), 1)
  k_off = jnp.where((t_idx < start)[:, None], k * masked_exp(b_edge - b), 0.0)
  dq_i += mm(da_ref[pl.ds(start, SUB), :], k_off, cd) * masked_exp(b_i - b_edge)
  # this sub-chunk's keys against later queries (none for the last)
  b_edge = rows(b_ref, start + SUB - 1, 1)
  q_off = jnp.where((t_idx >= start + SUB)[:, None], q * masked_exp(b - b_edge), 0.0)
  dk_i += mm(dat_ref[pl.ds(start, SUB), :], q_off, cd) * masked_exp(b_edge - b_i)

  dq_i, dk_i = _diag_grads(q_i, k_i, b_i, q_ref, k_ref, b_ref, da_ref, dat_ref, start, dq_i, dk_i)
  dq_ref[pl.ds(start, SUB), :] = dq_i.astype(dq_ref.dtype)
  dk_ref[pl.ds(start, SUB), :] = dk_i.astype(dk_ref.dtype)
  # extra is complete once the last sub-chunk has added its keys (above)
  last_row = (sub_rows == SUB - 1) & (i == N_SUB - 1)
  db_ref[pl.ds(start, SUB), :] = q_i * dq_i - k_i * dk_i + jnp.where(last_row, extra, 0.0)
  return extra


def _diag_grads(q_i, k_i, b_i, q_ref, k_ref, b_ref, da_ref, dat_ref, start, dq_i, dk_i):
  """dq, dk plus the diagonal block's score-gradient paths (dA is zero above the diagonal,
    its transpose dat below)."""
  b_r = rows(b_ref, start, 1)
  da_d = da_ref[pl.ds(start, SUB), pl.ds(start, SUB)]
  dat_d = dat_ref[pl.ds(start, SUB), pl.ds(start, SUB)]

  def factored(dq_i, dk_i):
    down, up = diag.decay_factors(b_i, b_r)
    return (dq_i + diag.f32_mm(da_d, k_i * up) * down, dk_i + diag.f32_mm(dat_d, q_i * down) * up)

  def exact(dq_i, dk_i):

    def diag_dq(j, dq_a):  # key j of the diagonal block
      col = da_ref[pl.ds(start, SUB), pl.ds(start + j, 1)]
      k_j, b_j = rows(k_ref, start + j, 1), rows(b_ref, start + j, 1)
      return dq_a + col * k_j * masked_exp(b_i - b_j)

    def diag_dk(t, dk_a):  # query t of the diagonal block
      col = dat_ref[pl.ds(start, SUB), pl.ds(start + t, 1)]
      q_t, b_t = rows(q_ref, start + t, 1), rows(b_ref, start + t, 1)
      return dk_a + col * q_t * masked_exp(b_t - b_i)

    return (jax.lax.fori_loop(0, SUB, diag_dq, dq_i), jax.lax.fori_loop(0, SUB, diag_dk, dk_i))

  return diag.choose(b_i, b_r, factored, exact, dq_i, dk_i)


def chunk_outputs(q, v, b, carry_in, h, a, *, scale, block_v, interpret, num_warps=4):
  """o [B, Tp, H, Dv] from the chunk start states h [B, H, NT, Dk, Dv] and scores a."""
  B, Tp, H, Dk = q.shape
  Dv = v.shape[-1]
  g = Grid()
  return chunk_call(
      functools.partial(_outputs_kernel, scale=scale, cd=compute_dtype(q.dtype)),
      (B, H, Tp // C, Dv // block_v),
      [
          g.all_channels(Dk),
          g.all_channels(Dk),
          g.flags(),
          g.state_columns(Dk, block_v),
          g.scores(),
          g.chunk(block_v)
      ],
      g.chunk(block_v),
      jax.ShapeDtypeStruct((B, Tp, H, Dv), v.dtype),
      num_warps=num_warps,
      interpret=interpret,
      name="gla_chunk_outputs",
  )(q, b, carry_in, h, a, v)


def chunk_value_grads(k, b, in_last, ds, a, do, *, scale, block_v, interpret, num_warps=4):
  """dv (v's dtype) from the end-state gradients ds and the scores a."""
  B, Tp, H, Dk = k.shape
  Dv = do.shape[-1]
  g = Grid()
  return chunk_call(
      functools.partial(_value_grads_kernel, scale=scale, cd=compute_dtype(k.dtype)),
      (B, H, Tp // C, Dv // block_v),
      [
          g.all_channels(Dk),
          g.all_channels(Dk),
          g.flags(),
          g.state_columns(Dk, block_v),
          g.scores(),
          g.chunk(block_v)
      ],
      g.chunk(block_v),
      jax.ShapeDtypeStruct(do.shape, do.dtype),
      num_warps=num_warps,
      interpret=interpret,
      name="gla_chunk_value_grads",
  )(k, b, in_last, ds, a, do)


def chunk_key_grads(q, k, v, b, carry_in, in_last, h, ds, do, da, dat, *, scale, block_k, interpret,
                    num_warps=4, num_stages=3, by_layout=False):
  """dq, dk (input dtype) and db (fp32, w.r.t. the in-chunk cumulative decay), given the
    start states h, the end-state gradients ds and dA (da, its transpose dat). num_stages
    software-pipelines the per-sub-chunk loads. by_layout: two kernels, the
    one-anchor chunks' (compiled with that path alone) and then the others' into the same
    outputs, instead of one kernel that branches per chunk."""
  B, Tp, H, Dk = q.shape
  Dv = v.shape[-1]
  g = Grid()
  keys = g.chunk(block_k)
  in_specs = [
      keys, keys,
      g.all_channels(Dv), keys,
      g.flags(),
      g.flags(),
      g.state_rows(block_k, Dv),
      g.state_rows(block_k, Dv),
      g.all_channels(Dv),
      g.scores(),
      g.scores()
  ]
  out_specs = (keys, keys, keys)
  out_shape = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
               jax.ShapeDtypeStruct(q.shape, F32))
  args = (q, k, v, b, carry_in, in_last, h, ds, do, da, dat)
  grid = (B, H, Tp // C, Dk // block_k)
  launch = dict(num_warps=num_warps, interpret=interpret, num_stages=num_stages)
  kw = dict(scale=scale, cd=compute_dtype(q.dtype))
  if not by_layout:
    return chunk_call(functools.partial(_key_grads_kernel, **kw), grid, in_specs, out_specs,
                      out_shape, name="gla_chunk_key_grads", **launch)(*args)
  first = chunk_call(functools.partial(_whole_chunk_pass_kernel, **kw), grid, in_specs, out_specs,
                     out_shape, name="gla_chunk_key_grads_whole_chunk", **launch)(*args)
  return chunk_call(functools.partial(_other_chunks_pass_kernel,
                                      **kw), grid, in_specs + list(out_specs), out_specs, out_shape,
                    name="gla_chunk_key_grads_other_chunks",
                    input_output_aliases={11 + i: i for i in range(3)}, **launch)(*args, *first)

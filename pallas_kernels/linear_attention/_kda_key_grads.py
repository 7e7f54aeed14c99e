"""The last KDA backward kernel: dq, dk, the gradient of the in-chunk cumulative decay b and
part of dbeta, one program per (batch, head, chunk, block of BK key channels).

Every path into q, k, b is separable over key channels, so a program only needs its
channel block: [16, BK] row tiles of 16 rows at a time, [BK, BV] state tiles and the
chunk's [64, 64] score gradients dP (of A_qk) and dA (of A_kk), read from memory. A
chunk whose decays factor (_chunk_factors) takes each step's score-gradient paths as one
matmul against the whole chunk; others by sub-chunk blocks as in _kda_scores. One kernel
branches per chunk, or two run one after the other (by_layout): the chunks with one
anchor, then the rest into the same outputs (the second forming its operands in each step,
through that step's anchor, so that none is held across the loop).
Paths (qg = q exp(b) ci, kg = k exp(b_last - b) il, K = k exp(b) ci, S / dS the chunk's
start state / end-state gradient, dX = T^T dv_new):
  o     += scale qg S            dqg = scale do S^T
  S_end += kg^T v_new            dkg = v_new dS^T;  b_last also scales S: sum_v S dS
  v_new  = T diag(beta) (v - K S):   dK = -beta dX S^T,  dbeta += -sum_d (dX S^T) K
  A_qk, A_kk = diag(beta) A~:     decayed-score gradients, per 16x16 block as in _kda_scores
Shared memory, BK = 64, Dv blocks of 64, bf16: dot operands [16, 64] / [64, 64] tiles,
under 40 KiB whatever Dk and Dv are.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention import _chunk_factors as factors
from pallas_kernels.linear_attention import _diagonal_blocks as diag
from pallas_kernels.linear_attention import _kda_layout as L
from pallas_kernels.linear_attention._kda_layout import C
from pallas_kernels.linear_attention._pallas_common import (F32, N_SUB, SUB, flag_column, iota,
                                                            masked_exp, mm, row_as_column, rows)


def _state_products(do_ref, vn_ref, dx_ref, h_ref, dh_ref, s, n, cd, block_v):
  """do S^T, v_new dS^T and dX S^T for the n rows at s ([n, BK] each)."""
  dqg = dkg = dxs = 0.0
  for j in range(do_ref.shape[-1] // block_v):
    cols = pl.ds(j * block_v, block_v)
    S, dS = h_ref[:, cols], dh_ref[:, cols]
    dqg += mm(do_ref[pl.ds(s, n), cols], S, cd, trans_b=True)
    dkg += mm(vn_ref[pl.ds(s, n), cols], dS, cd, trans_b=True)
    dxs += mm(dx_ref[pl.ds(s, n), cols], S, cd, trans_b=True)
  return dqg, dkg, dxs


def _state_overlap(h_ref, dh_ref, block_v):
  """sum_v S dS as a [1, BK] row: the gradient of exp(b_last) scaling the start state."""
  kept = jnp.zeros((1, h_ref.shape[0]), F32)
  for j in range(h_ref.shape[-1] // block_v):
    cols = pl.ds(j * block_v, block_v)
    kept += jnp.sum(h_ref[:, cols].astype(F32) * dh_ref[:, cols].astype(F32), axis=1)[None, :]
  return kept


def _score_grads(q_ref, k_ref, b_ref, beta_ref, dp_ref, da_ref, s, cd):
  """Gradients of the decayed scores for the sub-chunk at row s ([16, BK] each): dq from
    dP as queries, g = dA (x) k as queries of A_kk (dk = beta g), and dk as keys of both.
    s is a loop index: the first sub-chunk's earlier keys and the last one's later queries
    are empty masks."""
  t_idx = iota(C, 0, (C, 1))
  q, k, b = rows(q_ref, 0, C), rows(k_ref, 0, C), rows(b_ref, 0, C)
  b_i = rows(b_ref, s, SUB)
  # earlier keys, decay split at the last token of the previous sub-chunk
  b_edge = rows(b_ref, jnp.maximum(s - 1, 0), 1)
  k_off = jnp.where(t_idx < s, k * masked_exp(b_edge - b), 0.0)
  e_q = masked_exp(b_i - b_edge)
  dq = mm(dp_ref[pl.ds(s, SUB), :], k_off, cd) * e_q
  g = mm(da_ref[pl.ds(s, SUB), :], k_off, cd) * e_q
  # later queries, decay split at the last token of this sub-chunk
  b_edge = rows(b_ref, s + SUB - 1, 1)
  later = t_idx >= s + SUB
  e_later = masked_exp(b - b_edge)
  q_off = jnp.where(later, q * e_later, 0.0)
  kb_off = jnp.where(later, beta_ref[...].astype(F32)[:, None] * k * e_later, 0.0)
  dk = (mm(dp_ref[:, pl.ds(s, SUB)], q_off, cd, trans_a=True) +
        mm(da_ref[:, pl.ds(s, SUB)], kb_off, cd, trans_a=True)) * masked_exp(b_edge - b_i)

  return _diagonal(q_ref, k_ref, b_ref, beta_ref, dp_ref, da_ref, s, dq, g, dk)


def _diagonal(q_ref, k_ref, b_ref, beta_ref, dp_ref, da_ref, s, dq, g, dk):
  """Adds the diagonal block's paths: two matmuls each way where the sub-chunk's decays
    factor (_diagonal_blocks), else exact, one token at a time."""
  b_i, b_r = rows(b_ref, s, SUB), rows(b_ref, s, 1)

  def factored(dq, g, dk):
    down, up = diag.decay_factors(b_i, b_r)
    dp_d = dp_ref[pl.ds(s, SUB), pl.ds(s, SUB)].astype(F32)
    da_d = da_ref[pl.ds(s, SUB), pl.ds(s, SUB)].astype(F32)
    key = rows(k_ref, s, SUB) * up
    as_query = down * rows(q_ref, s, SUB)
    beta_k = down * beta_ref[pl.ds(s, SUB)].astype(F32)[:, None] * rows(k_ref, s, SUB)
    return (
        dq + diag.f32_mm(dp_d, key) * down, g + diag.f32_mm(da_d, key) * down, dk +
        (diag.f32_mm(dp_d, as_query, trans_a=True) + diag.f32_mm(da_d, beta_k, trans_a=True)) * up)

  def exact(dq, g, dk):

    def token(j, acc):  # token s + j as the key of rows s.. and as the query of rows s..
      dq, g, dk = acc
      q_j, k_j, b_j = rows(q_ref, s + j, 1), rows(k_ref, s + j, 1), rows(b_ref, s + j, 1)
      beta_j = beta_ref[pl.ds(s + j, 1)].astype(F32)[None, :]
      as_key = k_j * masked_exp(b_i - b_j)  # dP, dA are zero above / on the diagonal
      dq += dp_ref[pl.ds(s, SUB), pl.ds(s + j, 1)] * as_key
      g += da_ref[pl.ds(s, SUB), pl.ds(s + j, 1)] * as_key
      to_key = masked_exp(b_j - b_i)
      dp_row = row_as_column(dp_ref[pl.ds(s + j, 1), pl.ds(s, SUB)])
      da_row = row_as_column(da_ref[pl.ds(s + j, 1), pl.ds(s, SUB)])
      dk += (dp_row * q_j + da_row * beta_j * k_j) * to_key
      return dq, g, dk

    return jax.lax.fori_loop(0, SUB, token, (dq, g, dk))

  return diag.choose(b_i, b_r, factored, exact, dq, g, dk)


def _chunk_operands(q_ref, k_ref, b_ref, beta_ref, anchors):
  """The decayed operands of all 64 rows, each through its own anchor (_chunk_factors):
    keys k exp(m - b) and, as queries, q exp(b - m) and beta k exp(b - m)."""
  b, k = rows(b_ref, 0, C), rows(k_ref, 0, C)
  down, up = factors.factors(b, anchors.per_token())
  beta = beta_ref[...].astype(F32)[:, None]
  return k * up, rows(q_ref, 0, C) * down, beta * k * down


def _factored_score_grads(b_ref, dp_ref, da_ref, operands, anchors, i):
  """_score_grads for sub-chunk i of a chunk whose decays factor: one fp32-operand matmul
    per path against the whole chunk, its operands bridged to the sub-chunk's anchor."""
  key, q_down, bk_down = operands
  s = pl.multiple_of(i * SUB, SUB)
  down, up = anchors.step_factors(rows(b_ref, s, SUB), i)
  key = anchors.bridge(key, i, keys=True)
  dq = diag.f32_mm(dp_ref[pl.ds(s, SUB), :].astype(F32), key) * down
  g = diag.f32_mm(da_ref[pl.ds(s, SUB), :].astype(F32), key) * down
  dk = diag.f32_mm(dp_ref[:, pl.ds(s, SUB)].astype(F32), anchors.bridge(q_down, i, keys=False),
                   trans_a=True)
  dk += diag.f32_mm(da_ref[:, pl.ds(s, SUB)].astype(F32), anchors.bridge(bk_down, i, keys=False),
                    trans_a=True)
  return dq, g, dk * up


def _per_sub_chunk_score_grads(q_ref, k_ref, b_ref, beta_ref, dp_ref, da_ref, anchors, i):
  """_factored_score_grads for a chunk anchored per sub-chunk, its operands formed in the
    step straight through sub-chunk i's anchor m_i (what bridging each row's own anchor to
    m_i gives, to rounding): no operand is held across the loop. The rows whose pairs the
    causal mask keeps have exponents <= FACTOR_LIMIT (b falls, m_i is inside sub-chunk i's
    range); the others are clamped there, finite."""
  s = pl.multiple_of(i * SUB, SUB)
  down, up = anchors.step_factors(rows(b_ref, s, SUB), i)
  rel = rows(b_ref, 0, C) - anchors.of(i)
  k = rows(k_ref, 0, C)
  key = k * jnp.exp(jnp.minimum(-rel, diag.FACTOR_LIMIT) + factors.BRIDGE_SHIFT)
  as_query = jnp.exp(jnp.minimum(rel, diag.FACTOR_LIMIT) + factors.BRIDGE_SHIFT)
  beta = beta_ref[...].astype(F32)[:, None]
  dq = diag.f32_mm(dp_ref[pl.ds(s, SUB), :].astype(F32), key) * down
  g = diag.f32_mm(da_ref[pl.ds(s, SUB), :].astype(F32), key) * down
  dk = diag.f32_mm(dp_ref[:, pl.ds(s, SUB)].astype(F32), rows(q_ref, 0, C) * as_query, trans_a=True)
  dk += diag.f32_mm(da_ref[:, pl.ds(s, SUB)].astype(F32), beta * k * as_query, trans_a=True)
  return dq, g, dk * up


def _write_rows(q_ref, k_ref, b_ref, beta_ref, ci_ref, il_ref, h_ref, dh_ref, do_ref, vn_ref,
                dx_ref, dq_ref, dk_ref, db_ref, dbeta_ref, s, n, score_grads, db_last, closes, *,
                scale, cd, block_v):
  """Rows [s, s + n): the state paths added to the score-gradient terms (dq_p, g,
    dk_key); writes dq, dk, db, dbeta and returns db_last with these rows' keys added.
    closes: these rows end the chunk, so their last row carries db_last."""
  q_i, k_i, b_i = rows(q_ref, s, n), rows(k_ref, s, n), rows(b_ref, s, n)
  b_last = rows(b_ref, C - 1, 1)
  beta_i = beta_ref[pl.ds(s, n)].astype(F32)[:, None]
  ci_i = flag_column(ci_ref, s, n)
  dqg, dkg, dxs = _state_products(do_ref, vn_ref, dx_ref, h_ref, dh_ref, s, n, cd, block_v)
  dq_p, g, dk_key = score_grads
  k_w = k_i * jnp.exp(b_i) * ci_i  # K
  dk_end = dkg * masked_exp(b_last - b_i) * flag_column(il_ref, s, n)
  dk_w = -beta_i * dxs * jnp.exp(b_i) * ci_i
  dq = scale * dqg * jnp.exp(b_i) * ci_i + dq_p
  dk = dk_end + dk_w + beta_i * g + dk_key
  db = q_i * dq + k_i * (dk_w + beta_i * g - dk_end - dk_key)
  db_last += jnp.sum(k_i * dk_end, axis=0, keepdims=True)
  db += jnp.where((iota(n, 0, (n, 1)) == n - 1) & closes, db_last, 0.0)
  dbeta = jnp.sum(k_i * g, axis=1) - jnp.sum(dxs * k_w, axis=1)
  dq_ref[pl.ds(s, n), :] = dq.astype(dq_ref.dtype)
  dk_ref[pl.ds(s, n), :] = dk.astype(dk_ref.dtype)
  db_ref[pl.ds(s, n), :] = db
  dbeta_ref[pl.ds(s, n)] = dbeta
  return db_last


def _key_grads(refs, layout, *, scale, cd, block_v):
  """One chunk's key gradients, one loop step per 16-token sub-chunk: with (anchors,
    factored_ok) = layout(), factored through the anchors (_chunk_factors) where
    factored_ok, else by 16x16 blocks; factored_ok is traced, or True where only the
    factored steps are compiled. Unrolled, the kernel's code outgrew the instruction cache
    (the GLA kernels' 'no instruction' stalls, docs/performance.md)."""
  q_ref, k_ref, b_ref, beta_ref, ci_ref, il_ref, h_ref, dh_ref = refs[:8]
  dp_ref, da_ref = refs[15:]
  refs = refs[:15]
  b_last = rows(b_ref, C - 1, 1)
  keep = jnp.max(ci_ref[pl.ds(C - 1, 1)]).astype(F32)
  # b_last scales the surviving start state and every kg row
  db_last = keep * _state_overlap(h_ref, dh_ref, block_v) * jnp.exp(b_last)
  kw = dict(scale=scale, cd=cd, block_v=block_v)

  def loop(score_grads):  # score_grads(i, s) for sub-chunk i at row s, then its writes

    def step(i, db_last):
      s = pl.multiple_of(i * SUB, SUB)
      return _write_rows(*refs, s, SUB, score_grads(i, s), db_last, i == N_SUB - 1, **kw)

    jax.lax.fori_loop(0, N_SUB, step, db_last)

  per_sub_chunk = lambda i, s: _per_sub_chunk_score_grads(q_ref, k_ref, b_ref, beta_ref, dp_ref,
                                                          da_ref, anchors, i)
  by_blocks = lambda i, s: _score_grads(q_ref, k_ref, b_ref, beta_ref, dp_ref, da_ref, s, cd)

  def factored():
    if anchors.uniform is False:  # a pass of its own: operands formed per step
      loop(per_sub_chunk)
    else:
      operands = _chunk_operands(q_ref, k_ref, b_ref, beta_ref, anchors)
      loop(lambda i, s: _factored_score_grads(b_ref, dp_ref, da_ref, operands, anchors, i))

  # the anchors after the above: the one kernel spills less so (kernel_resources)
  anchors, factored_ok = layout()
  factors.factored_or(factored_ok, factored, lambda: loop(by_blocks))


def _ordered(ins, outs):
  """_key_grads' refs: the inputs but dP, dA (_write_rows' order), the outputs, dP, dA."""
  return (*ins[:11], *outs, *ins[11:13])


def _key_grads_kernel(*refs, **kw):
  """Every layout in one kernel, branching per chunk."""
  ins, outs = refs[:13], refs[13:]
  _key_grads(_ordered(ins, outs), lambda: factors.anchors(ins[2]), **kw)


def _whole_chunk_pass_kernel(*refs, **kw):
  """The first of two passes: the chunks whose decays factor over one anchor (in this key
    block's channels); it leaves the others' rows to the second pass."""
  ins, outs = refs[:13], refs[13:]
  factors.if_whole_chunk(ins[2], lambda layout: _key_grads(_ordered(ins, outs), layout, **kw))


def _other_chunks_pass_kernel(*refs, **kw):
  """The second pass: the chunks the first left, not anchored whole in this key block's
    channels (its outputs are the first pass's, aliased; the first pass's rows stay)."""
  ins, outs = refs[:13], refs[17:]  # refs[13:17]: the first pass's outputs, aliased
  factors.unless_whole_chunk(ins[2], lambda layout: _key_grads(_ordered(ins, outs), layout, **kw))


# 4 warps: two programs an SM (by shared memory), with spills on the factored path; 8:
# none, one program; they tied (docs/kernel_tuning.md, "KDA key gradients").
WARPS = 4


def chunk_key_grads(q, k, b, beta, carry_in, in_last, h, dh, do, vn, dx, dp, da, *, scale, block_k,
                    block_v, cd, interpret, num_warps=WARPS, form="by_layout", other_warps=None):
  """(dq, dk in their input dtypes, db fp32 [B,Tp,H,Dk], dbeta partial fp32 [B,Tp,H]).

    form (_chunk_factors.KEY_GRAD_KERNELS): one kernel that branches per chunk; by_layout,
    two kernels, the whole-chunk-anchored chunks' and then the others' into its outputs,
    each compiled with its own path alone (the one kernel holds the bridged per-sub-chunk
    operands beside the loop-invariant ones wherever it runs, and spills;
    docs/kernel_tuning.md, "KDA key gradients"). other_warps: the kernel of the chunks not
    anchored whole
    (default num_warps): at eight it holds its registers without spilling, at one program
    an SM (experiments/kernel_resources.py)."""
  if form not in factors.KEY_GRAD_KERNELS:
    raise ValueError(f"form = {form!r}: expected one of {list(factors.KEY_GRAD_KERNELS)}")
  B, Tp, H, Dk = q.shape
  Dv = do.shape[-1]
  nk = Dk // block_k
  keys, vals = L.kblock_rows(block_k), L.kblock_values(Dv)
  state, square, flag = L.kblock_state(block_k, Dv), L.kblock_square(), L.kblock_flags()
  in_specs = [
      keys, keys, keys,
      L.kblock_beta(), flag, flag, state, state, vals, vals, vals, square, square
  ]
  out_specs = (keys, keys, keys, L.kblock_partial_beta())
  out_shape = (L.shape(q.dtype, B, Tp, H, Dk), L.shape(k.dtype, B, Tp, H,
                                                       Dk), L.shape(F32, B, Tp, H,
                                                                    Dk), L.shape(F32, B, nk, Tp, H))
  # two stages keep the sub-chunk loop's loads in flight (three would need 194 KiB of
  # shared memory); docs/kernel_tuning.md, "KDA key gradients"
  launch = dict(interpret=interpret, num_warps=num_warps, num_stages=2)
  kw = dict(scale=scale, cd=cd, block_v=block_v)
  args = (q, k, b, beta, carry_in, in_last, h, dh, do, vn, dx, dp, da)
  grid = (B, H, Tp // C, nk)
  others = launch | dict(num_warps=other_warps or num_warps)
  if form == "one_kernel":
    outs = L.call(functools.partial(_key_grads_kernel, **kw), grid, in_specs, out_specs, out_shape,
                  name="kda_key_grads", **launch)(*args)
  else:
    first = L.call(functools.partial(_whole_chunk_pass_kernel, **kw), grid, in_specs, out_specs,
                   out_shape, name="kda_key_grads_whole_chunk", **launch)(*args)
    outs = L.call(functools.partial(_other_chunks_pass_kernel,
                                    **kw), grid, in_specs + list(out_specs), out_specs, out_shape,
                  name="kda_key_grads_other_chunks",
                  input_output_aliases={13 + i: i for i in range(4)}, **others)(*args, *first)
  dq, dk, db, dbeta = outs
  return dq, dk, db, jnp.sum(dbeta, axis=1)

"""In-chunk KDA kernels (parallel over batch, head, chunk): everything a 64-token chunk
needs that does not depend on the state entering it.

With b the in-chunk cumulative log decay (<= 0, non-increasing), ci / il the carry_in /
in_last flags (see _chunk_prep.segment_masks) and beta the per-token write strength:
  A_kk[t, s] = beta_t k_t . (k_s exp(b_t - b_s))   s < t, same run     T = (I + A_kk)^-1
  A_qk[t, s] = q_t . (k_s exp(b_t - b_s))          s <= t, same run
  w  = T diag(beta) (k exp(b) ci)     u0 = T diag(beta) v
  qg = q exp(b) ci                    kg = k exp(b_last - b) il
so that, with S the chunk's start state, v_new = u0 - w S, o = scale (qg S + A_qk v_new)
and the next state is keep exp(b_last) S + kg^T v_new.

Two kernels: the scores A_kk, A_qk and qg, kg, one program per chunk (_kda_scores);
then, one program per chunk, T by blockwise forward substitution
(16-step substitutions for the four diagonal blocks, exact fp32 16x16 matmuls below)
and w, u0 from T's 16x16 blocks. Live tiles are [16, D] (D = 256: 16 KiB fp32) plus ten
16x16 blocks of T, so shared memory stays far below the limit at any D <= 256.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention import _kda_layout as L
from pallas_kernels.linear_attention._kda_layout import C
from pallas_kernels.linear_attention._kda_scores import chunk_scores
from pallas_kernels.linear_attention._pallas_common import (F32, N_SUB, SUB, flag_column, iota, mm,
                                                            rows)


def exact_dot(a, b):
  """fp32 16x16 product at full precision: the inverse amplifies rounding when keys are
    nearly parallel (see test_kda_stability)."""
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=F32)


def _inverse_16(m):
  """(I + m)^-1 for a strictly lower-triangular 16x16 m by forward substitution:
    row t is e_t - m[t, :] @ inv, whose rows s < t are already final."""
  r, c = iota(SUB, 0, (SUB, SUB)), iota(SUB, 1, (SUB, SUB))
  eye = jnp.where(r == c, 1.0, 0.0)

  def step(t, inv):
    m_t = jnp.sum(jnp.where(r == t, m, 0.0), axis=0)
    new = -jnp.sum(m_t[:, None] * inv, axis=0)
    return jnp.where(r == t, new[None, :] + eye, inv)

  return jax.lax.fori_loop(1, SUB, step, eye)


def unit_lower_inverse(a):
  """Blocks of (I + A)^-1 from the 16x16 blocks a[i][j] (j <= i) of a strictly lower A:
    T_ii = (I + A_ii)^-1,  T_ij = -T_ii sum_{m=j}^{i-1} A_im T_mj."""
  t = [[None] * N_SUB for _ in range(N_SUB)]
  for i in range(N_SUB):
    t[i][i] = _inverse_16(a[i][i])
    for j in range(i - 1, -1, -1):
      acc = exact_dot(a[i][j], t[j][j])
      for m in range(j + 1, i):
        acc += exact_dot(a[i][m], t[m][j])
      t[i][j] = -exact_dot(t[i][i], acc)
  return t


def _solve_kernel(akk_ref, k_ref, v_ref, b_ref, beta_ref, ci_ref, w_ref, u0_ref, *inverse_ref, cd):
  a_kk = [[akk_ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)]
           for j in range(i + 1)]
          for i in range(N_SUB)]
  t = unit_lower_inverse(a_kk)
  betas = [beta_ref[pl.ds(i * SUB, SUB)].astype(F32)[:, None] for i in range(N_SUB)]
  for i in range(N_SUB):
    w_i = u_i = 0.0
    for j in range(i + 1):
      s = j * SUB
      k_j = rows(k_ref, s, SUB) * jnp.exp(rows(b_ref, s, SUB)) * flag_column(ci_ref, s)
      w_i += mm(t[i][j], betas[j] * k_j, cd)
      u_i += mm(t[i][j], betas[j] * rows(v_ref, s, SUB), cd)
    w_ref[pl.ds(i * SUB, SUB), :] = w_i.astype(w_ref.dtype)
    u0_ref[pl.ds(i * SUB, SUB), :] = u_i.astype(u0_ref.dtype)
  if inverse_ref:
    (inv_ref,) = inverse_ref
    for i in range(N_SUB):
      for j in range(N_SUB):
        blk = t[i][j] if j <= i else jnp.zeros((SUB, SUB), F32)
        inv_ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = blk.astype(inv_ref.dtype)


def chunk_intra(q, k, v, b, beta, runs, carry_in, in_last, *, cd, emit_inverse, interpret,
                scores_by_layout=True):
  """(qg, kg, w [B,Tp,H,Dk], u0 [B,Tp,H,Dv], A_qk [B,H,n,C,C], and T [B,H,n,C,C] when
    emit_inverse), all in the compute dtype cd."""
  B, Tp, H, Dk = k.shape
  Dv = v.shape[-1]
  n = Tp // C
  qg, kg, a_kk, a_qk = chunk_scores(q, k, b, beta, runs, carry_in, in_last, cd=cd,
                                    interpret=interpret, by_layout=scores_by_layout)
  keys, values, square = L.chunk_rows(Dk), L.chunk_rows(Dv), L.chunk_square()
  out_specs, out_shape = [keys, values], [L.shape(cd, B, Tp, H, Dk), L.shape(cd, B, Tp, H, Dv)]
  if emit_inverse:
    out_specs.append(square)
    out_shape.append(L.shape(cd, B, H, n, C, C))
  # Four warps: one (more programs per SM) spills; chosen by measurement:
  # docs/kernel_tuning.md, "KDA in-chunk solve"
  solved = L.call(functools.partial(_solve_kernel, cd=cd), (B, H, n),
                  [square, keys, values, keys,
                   L.chunk_beta(), L.chunk_flags()], tuple(out_specs), tuple(out_shape),
                  interpret=interpret, name="kda_chunk_solve", num_warps=4)(a_kk, k, v, b, beta,
                                                                            carry_in)
  return (qg, kg, solved[0], solved[1], a_qk, *solved[2:])

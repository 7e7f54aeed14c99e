"""In-chunk KDA scores, one program per (batch row, head, chunk, 16-token sub-chunk).

With b the in-chunk cumulative log decay, the sub-chunk's rows of
  A_kk[t, s] = beta_t k_t . (k_s exp(b_t - b_s))   s < t, same run (fp32: the inverse
                                                   T = (I + A_kk)^-1 amplifies rounding)
  A_qk[t, s] = q_t . (k_s exp(b_t - b_s))          s <= t, same run
and its rows of qg = q exp(b) ci and kg = k exp(b_last - b) il (see _kda_intra). Keys of
earlier sub-chunks are one block (_score_rows: one tensor-core matmul each for A_kk and
A_qk); the diagonal block factors through the sub-chunk's first token where its decays
allow (_diagonal_blocks) and is otherwise formed exactly, one key at a time.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention import _diagonal_blocks as diag
from pallas_kernels.linear_attention import _kda_layout as L
from pallas_kernels.linear_attention._kda_layout import C, N_SUB
from pallas_kernels.linear_attention._pallas_common import (
    F32, SUB, chunk_program_id, flag_column, iota, masked_exp, rows)
from pallas_kernels.linear_attention._score_rows import (
    edge_decay, store_diagonal, store_row_blocks)


def _diagonal_blocks(q_i, k_i, b_i, k_ref, b_ref, start):
    """16x16 diagonal blocks of A_kk / beta (strict) and A_qk: two matmuls where the
    sub-chunk's decays factor (_diagonal_blocks), else exact, one key at a time."""
    b_r = rows(b_ref, start, 1)

    def factored(q_i, k_i, b_i):
        down, up = diag.decay_factors(b_i, b_r)
        key = k_i * up
        return (diag.lower(diag.f32_mm(k_i * down, key, trans_b=True), strict=True),
                diag.lower(diag.f32_mm(q_i * down, key, trans_b=True)))

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


def _scores_kernel(q_ref, k_ref, b_ref, beta_ref, r_ref, ci_ref, il_ref,
                   qg_ref, kg_ref, akk_ref, aqk_ref, *, cd):
    """q_ref, beta_ref, qg_ref, kg_ref hold the sub-chunk's rows; k, b and the flags the
    chunk's."""
    start = pl.multiple_of(chunk_program_id() * SUB, SUB)
    q_i, k_i, b_i = q_ref[...].astype(F32), rows(k_ref, start, SUB), rows(b_ref, start, SUB)
    beta_i = beta_ref[...].astype(F32)[:, None]
    qg_ref[...] = (q_i * jnp.exp(b_i) * flag_column(ci_ref, start)).astype(qg_ref.dtype)
    b_last = rows(b_ref, C - 1, 1)
    kg_ref[...] = (k_i * masked_exp(b_last - b_i) * flag_column(il_ref, start)).astype(kg_ref.dtype)

    b_edge = edge_decay(b_ref, start)
    to_edge = masked_exp(b_i - b_edge)
    store_row_blocks([(akk_ref, beta_i * k_i * to_edge, cd), (aqk_ref, q_i * to_edge, cd)],
                     k_ref, b_ref, r_ref, start, b_edge)

    kk_d, qk_d = _diagonal_blocks(q_i, k_i, b_i, k_ref, b_ref, start)
    r_i = r_ref[pl.ds(start, SUB)]
    same = r_i[:, None] == r_ref[pl.ds(start, SUB)][None, :]
    store_diagonal(akk_ref, jnp.where(same, beta_i * kk_d, 0.0), start)
    store_diagonal(aqk_ref, jnp.where(same, qk_d, 0.0), start)


def chunk_scores(q, k, b, beta, runs, carry_in, in_last, *, cd, interpret):
    """(qg, kg [B, Tp, H, Dk] in cd, A_kk [B, H, n, C, C] fp32, A_qk [B, H, n, C, C] in cd)."""
    B, Tp, H, Dk = k.shape
    n = Tp // C
    flag = L.sub_chunk_flags()
    rows_out, square = L.sub_rows(Dk), L.sub_square_rows()
    # H200, (2, 8192, 64, 128): 6.6 ms with 4 warps, 8.5 with 2 (another run); two stages
    # keep the loops' loads over earlier sub-chunks in flight: 4.7 ms, 5.9 with one
    return L.call(functools.partial(_scores_kernel, cd=cd), (B, H, n, N_SUB),
                  [L.sub_rows(Dk), L.sub_chunk_rows(Dk), L.sub_chunk_rows(Dk), L.sub_beta(),
                   flag, flag, flag],
                  (rows_out, rows_out, square, square),
                  (L.shape(cd, B, Tp, H, Dk),) * 2 + (L.shape(F32, B, H, n, C, C),
                                                      L.shape(cd, B, H, n, C, C)),
                  interpret=interpret, name="kda_chunk_scores", num_warps=4, num_stages=2,
                  )(q, k, b, beta, runs, carry_in, in_last)

"""In-chunk KDA kernel (parallel over batch, head, chunk): everything a 64-token chunk
needs that does not depend on the state entering it.

With b the in-chunk cumulative log decay (<= 0, non-increasing), ci / il the carry_in /
in_last flags (see _chunk_prep.segment_masks) and beta the per-token write strength:
  A_kk[t, s] = beta_t k_t . (k_s exp(b_t - b_s))   s < t, same run     T = (I + A_kk)^-1
  A_qk[t, s] = q_t . (k_s exp(b_t - b_s))          s <= t, same run
  w  = T diag(beta) (k exp(b) ci)     u0 = T diag(beta) v
  qg = q exp(b) ci                    kg = k exp(b_last - b) il
so that, with S the chunk's start state, v_new = u0 - w S, o = scale (qg S + A_qk v_new)
and the next state is keep exp(b_last) S + kg^T v_new.

Everything is built from 16x16 blocks: blocks below the diagonal factor the decay
through the sub-chunk boundaries (every exponent <= 0, one tensor-core matmul per block),
diagonal blocks factor through the sub-chunk's first token where its decays allow
(_diagonal_blocks) and otherwise form each exp(b_t - b_s) exactly (16 steps over
[16, Dk] tiles), and T
comes from blockwise forward substitution: 16-step substitutions for the four diagonal
blocks, exact fp32 16x16 matmuls below. Live tiles are [16, D] (D = 256: 16 KiB fp32)
plus ten 16x16 blocks of T; dot operands are at most [16, 256] + [16, 256] in the compute
dtype (16 KiB bf16), so shared memory stays far below the limit at any D <= 256.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention import _diagonal_blocks as diag
from pallas_kernels.linear_attention import _kda_layout as L
from pallas_kernels.linear_attention._kda_layout import C, N_SUB
from pallas_kernels.linear_attention._pallas_common import F32, SUB, iota, masked_exp, mm, rows


def exact_dot(a, b):
    """fp32 16x16 product at full precision: the inverse amplifies rounding when keys are
    nearly parallel (see test_kda_stability)."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST, preferred_element_type=F32)


def flags(ref, start, n=SUB):
    """[n, 1] fp32 column of 0/1 flags."""
    return ref[pl.ds(start, n)].astype(F32)[:, None]


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


def _intra_kernel(q_ref, k_ref, v_ref, b_ref, beta_ref, r_ref, ci_ref, il_ref,
                  qg_ref, kg_ref, w_ref, u0_ref, aqk_ref, *inverse_ref, cd):
    b_last = rows(b_ref, C - 1, 1)
    runs = [r_ref[pl.ds(i * SUB, SUB)] for i in range(N_SUB)]
    betas = [beta_ref[pl.ds(i * SUB, SUB)].astype(F32)[:, None] for i in range(N_SUB)]

    a_kk = [[None] * N_SUB for _ in range(N_SUB)]
    for i in range(N_SUB):
        s = i * SUB
        q_i, k_i, b_i = rows(q_ref, s, SUB), rows(k_ref, s, SUB), rows(b_ref, s, SUB)
        ci_i, il_i = flags(ci_ref, s), flags(il_ref, s)
        qg_ref[pl.ds(s, SUB), :] = (q_i * jnp.exp(b_i) * ci_i).astype(qg_ref.dtype)
        kg_ref[pl.ds(s, SUB), :] = (k_i * masked_exp(b_last - b_i) * il_i).astype(kg_ref.dtype)
        kk_ii, qk_ii = _diagonal_blocks(q_i, k_i, b_i, k_ref, b_ref, s)
        a_kk[i][i] = jnp.where(runs[i][:, None] == runs[i][None, :], betas[i] * kk_ii, 0.0)
        aqk_ref[pl.ds(s, SUB), pl.ds(s, SUB)] = jnp.where(
            runs[i][:, None] == runs[i][None, :], qk_ii, 0.0).astype(aqk_ref.dtype)
        if i > 0:  # reference point: the last token of sub-chunk i - 1
            b_edge = rows(b_ref, s - 1, 1)
            k_dec, q_dec = k_i * masked_exp(b_i - b_edge), q_i * masked_exp(b_i - b_edge)
        for j in range(i):
            key = rows(k_ref, j * SUB, SUB) * masked_exp(b_edge - rows(b_ref, j * SUB, SUB))
            same = runs[i][:, None] == runs[j][None, :]
            a_kk[i][j] = jnp.where(same, betas[i] * mm(k_dec, key, cd, trans_b=True), 0.0)
            aqk_ref[pl.ds(s, SUB), pl.ds(j * SUB, SUB)] = jnp.where(
                same, mm(q_dec, key, cd, trans_b=True), 0.0).astype(aqk_ref.dtype)
        for j in range(i + 1, N_SUB):
            aqk_ref[pl.ds(s, SUB), pl.ds(j * SUB, SUB)] = jnp.zeros((SUB, SUB), aqk_ref.dtype)

    t = unit_lower_inverse(a_kk)
    for i in range(N_SUB):
        w_i = u_i = 0.0
        for j in range(i + 1):
            s = j * SUB
            k_j = rows(k_ref, s, SUB) * jnp.exp(rows(b_ref, s, SUB)) * flags(ci_ref, s)
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


def chunk_intra(q, k, v, b, beta, runs, carry_in, in_last, *, cd, emit_inverse, interpret):
    """(qg, kg, w [B,Tp,H,Dk], u0 [B,Tp,H,Dv], A_qk [B,H,n,C,C], and T [B,H,n,C,C] when
    emit_inverse), all in the compute dtype cd."""
    B, Tp, H, Dk = k.shape
    Dv = v.shape[-1]
    n = Tp // C
    keys, values, square = L.chunk_rows(Dk), L.chunk_rows(Dv), L.chunk_square()
    out_specs = [keys, keys, keys, values, square]
    out_shape = [L.shape(cd, B, Tp, H, Dk)] * 3 + [L.shape(cd, B, Tp, H, Dv),
                                                   L.shape(cd, B, H, n, C, C)]
    if emit_inverse:
        out_specs.append(square)
        out_shape.append(L.shape(cd, B, H, n, C, C))
    flag = L.chunk_flags()
    # A serial chain of small steps per program: one warp per program lets more programs
    # share an SM (H200, (2, 8192, 64, 128): 10.1 ms; 2 warps 11.3; at (1, 8192, 64, 128)
    # 2 warps 5.8, 4 warps 8.8, 8 warps 14.9)
    return L.call(functools.partial(_intra_kernel, cd=cd), (B, H, n),
                  [keys, keys, values, keys, L.chunk_beta(), flag, flag, flag],
                  tuple(out_specs), tuple(out_shape), interpret=interpret,
                  name="kda_intra", num_warps=1)(q, k, v, b, beta, runs, carry_in, in_last)

"""The two parallel GLA kernels: one program per (batch row, head, chunk of 64 tokens).

Given the chunk's start state (and, backward, the gradient of its end state) every
chunk is independent, so these kernels fill the GPU whatever B and H are. Inside a
chunk the scores A[t, s] = sum_d q_t[d] k_s[d] exp(b_t[d] - b_s[d]) (b: in-chunk
cumulative log decay) are built per 16-token sub-chunk: blocks below the diagonal
factor the decay through the sub-chunk boundary (both factors <= 1, so tensor-core
matmuls); diagonal blocks factor through the sub-chunk's first token where its decays
allow (_diagonal_blocks) and otherwise form each exp(b_t - b_s <= 0) exactly, one key at
a time, so decays down to g = -20 per token stay finite.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.linear_attention import _diagonal_blocks as diag
from pallas_kernels.linear_attention._inputs import CHUNK as C
from pallas_kernels.linear_attention._pallas_common import (
    F32, SUB, compiler_params, compute_dtype, iota, masked_exp, mm, rows)

N_SUB = C // SUB


def _flags(ref, start, n):
    return ref[pl.ds(start, n)]


def _diag_scores(q_i, b_i, r_i, k_ref, b_ref, r_ref, start):
    """Scores of one 16x16 diagonal block: one matmul, or exact one key column at a time."""
    b_r = rows(b_ref, start, 1)
    same = r_i[:, None] == _flags(r_ref, start, SUB)[None, :]

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


def score_rows(q_i, b_i, r_i, k_all, b_all, r_all, k_ref, b_ref, r_ref, start, cd):
    """The sub-chunk's row block of A: (its [16, C] part left of the diagonal block, zero
    from column `start` on; the [16, 16] diagonal block)."""
    cols = iota(C, 1, (SUB, C))
    # keys of earlier sub-chunks as one block, the decay split at the sub-chunk boundary;
    # columns at or past `start` are masked (their exponents clamped to <= 0)
    b_edge = rows(b_ref, jnp.maximum(start - 1, 0), 1)
    k_off = jnp.where((iota(C) < start)[:, None], k_all * masked_exp(b_edge - b_all), 0.0)
    a_off = mm(q_i * masked_exp(b_i - b_edge), k_off, cd, trans_b=True)
    a_off = jnp.where((cols < start) & (r_i[:, None] == r_all[None, :]), a_off, 0.0)
    return a_off, _diag_scores(q_i, b_i, r_i, k_ref, b_ref, r_ref, start)


def store_score_rows(a_ref, start, a_off, a_d):
    """Writes the row block: the diagonal block, and everything else (zero past it)."""
    cols = iota(C, 1, (SUB, C))
    in_diag = (cols >= start) & (cols < start + SUB)
    plgpu.store(a_ref.at[pl.ds(start, SUB), :], a_off, mask=~in_diag)
    a_ref[pl.ds(start, SUB), pl.ds(start, SUB)] = a_d


def _output_kernel(q_ref, k_ref, v_ref, b_ref, r_ref, ci_ref, h_ref, o_ref, a_ref, *, scale, cd):
    """One loop step per 16-token sub-chunk (a loop, not unrolled: the unrolled kernel's
    code outgrew the instruction cache, ncu's 'no instruction' stall)."""
    S = h_ref[...]
    k_all, b_all, v_all = rows(k_ref, 0, C), rows(b_ref, 0, C), v_ref[...]
    r_all = r_ref[...]

    def sub_chunk(i, carry):
        start = pl.multiple_of(i * SUB, SUB)
        q_i, b_i = rows(q_ref, start, SUB), rows(b_ref, start, SUB)
        r_i = _flags(r_ref, start, SUB)
        ci_i = _flags(ci_ref, start, SUB).astype(F32)[:, None]
        a_off, a_d = score_rows(q_i, b_i, r_i, k_all, b_all, r_all, k_ref, b_ref, r_ref,
                                start, cd)
        o_i = (mm(q_i * jnp.exp(b_i) * ci_i, S, cd) + mm(a_off, v_all, cd)
               + mm(a_d, v_ref[pl.ds(start, SUB), :], cd))
        o_ref[pl.ds(start, SUB), :] = (scale * o_i).astype(o_ref.dtype)
        store_score_rows(a_ref, start, a_off, a_d)
        return carry

    jax.lax.fori_loop(0, N_SUB, sub_chunk, 0)


def _dscores_kernel(v_ref, r_ref, do_ref, da_ref, dat_ref, *, scale, cd):
    """dA = scale * do v^T on the causal same-segment pairs, and its transpose."""
    v, do, r = v_ref[...], do_ref[...], r_ref[...]
    t, s = iota(C, 0, (C, C)), iota(C, 1, (C, C))
    same = r[:, None] == r[None, :]
    da_ref[...] = jnp.where(same & (s <= t), scale * mm(do, v, cd, trans_b=True), 0.0)
    dat_ref[...] = jnp.where(same & (s >= t), scale * mm(v, do, cd, trans_b=True), 0.0)


def grads_kernel(q_ref, k_ref, v_ref, b_ref, ci_ref, il_ref, h_ref, ds_ref, hds_ref, do_ref,
                 a_ref, da_ref, dat_ref, dq_ref, dk_ref, db_ref, *dv_ref, scale, cd):
    """Every score and score gradient is read from a_ref / da_ref / dat_ref, so the exact
    diagonal blocks take one column load per step and no cross-thread reductions. One
    loop step per sub-chunk, as in the output kernel. Every path into dq, dk and db is
    separable over key channels: the refs q, k, b, h, ds, hds may hold a block of them
    (the split layout, _gla_split), in which case dv is left to its own kernel (no dv_ref)."""
    t_idx = iota(C)
    sub_rows = iota(SUB, 0, (SUB, 1))
    S, dS = h_ref[...], ds_ref[...]  # matmul operands only: kept in the compute dtype
    q, k, b = rows(q_ref, 0, C), rows(k_ref, 0, C), rows(b_ref, 0, C)
    do = do_ref[...]
    b_last = rows(b_ref, C - 1, 1)
    keep = jnp.max(_flags(ci_ref, C - 1, 1)).astype(F32)

    def sub_chunk(i, extra):
        start = pl.multiple_of(i * SUB, SUB)
        q_i, k_i, b_i = (rows(x, start, SUB) for x in (q_ref, k_ref, b_ref))
        v_i, do_i = rows(v_ref, start, SUB), rows(do_ref, start, SUB)
        ci_i = _flags(ci_ref, start, SUB).astype(F32)[:, None]
        il_i = _flags(il_ref, start, SUB).astype(F32)[:, None]
        # state paths: o <- start state (queries), end state <- k, v (keys)
        dq_i = scale * mm(do_i, S, cd, trans_b=True) * jnp.exp(b_i) * ci_i
        decay_to_end = masked_exp(b_last - b_i) * il_i
        dk_i = mm(v_i, dS, cd, trans_b=True) * decay_to_end
        if dv_ref:
            dv_i = (mm(k_i * decay_to_end, dS, cd)
                    + scale * mm(a_ref[:, pl.ds(start, SUB)], do, cd, trans_a=True))
        extra += jnp.sum(k_i * dk_i, axis=0, keepdims=True)
        # this sub-chunk's queries against earlier keys (none for the first: all masked)
        b_edge = rows(b_ref, jnp.maximum(start - 1, 0), 1)
        k_off = jnp.where((t_idx < start)[:, None], k * masked_exp(b_edge - b), 0.0)
        dq_i += mm(da_ref[pl.ds(start, SUB), :], k_off, cd) * masked_exp(b_i - b_edge)
        # this sub-chunk's keys against later queries (none for the last)
        b_edge = rows(b_ref, start + SUB - 1, 1)
        q_off = jnp.where((t_idx >= start + SUB)[:, None], q * masked_exp(b - b_edge), 0.0)
        dk_i += mm(dat_ref[pl.ds(start, SUB), :], q_off, cd) * masked_exp(b_edge - b_i)

        dq_i, dk_i = _diag_grads(q_i, k_i, b_i, q_ref, k_ref, b_ref, da_ref, dat_ref, start,
                                 dq_i, dk_i)
        dq_ref[pl.ds(start, SUB), :] = dq_i.astype(dq_ref.dtype)
        dk_ref[pl.ds(start, SUB), :] = dk_i.astype(dk_ref.dtype)
        # extra is complete once the last sub-chunk has added its keys (above)
        last_row = (sub_rows == SUB - 1) & (i == N_SUB - 1)
        db_ref[pl.ds(start, SUB), :] = q_i * dq_i - k_i * dk_i + jnp.where(last_row, extra, 0.0)
        if dv_ref:
            dv_ref[0][pl.ds(start, SUB), :] = dv_i.astype(dv_ref[0].dtype)
        return extra

    # b_last scales the surviving start state and every key's decay to the chunk end
    jax.lax.fori_loop(0, N_SUB, sub_chunk, keep * hds_ref[...][None, :] * jnp.exp(b_last))


def _diag_grads(q_i, k_i, b_i, q_ref, k_ref, b_ref, da_ref, dat_ref, start, dq_i, dk_i):
    """dq, dk plus the diagonal block's score-gradient paths (dA is zero above the diagonal,
    its transpose dat below)."""
    b_r = rows(b_ref, start, 1)
    da_d = da_ref[pl.ds(start, SUB), pl.ds(start, SUB)]
    dat_d = dat_ref[pl.ds(start, SUB), pl.ds(start, SUB)]

    def factored(dq_i, dk_i):
        down, up = diag.decay_factors(b_i, b_r)
        return (dq_i + diag.f32_mm(da_d, k_i * up) * down,
                dk_i + diag.f32_mm(dat_d, q_i * down) * up)

    def exact(dq_i, dk_i):
        def diag_dq(j, dq_a):  # key j of the diagonal block
            col = da_ref[pl.ds(start, SUB), pl.ds(start + j, 1)]
            k_j, b_j = rows(k_ref, start + j, 1), rows(b_ref, start + j, 1)
            return dq_a + col * k_j * masked_exp(b_i - b_j)

        def diag_dk(t, dk_a):  # query t of the diagonal block
            col = dat_ref[pl.ds(start, SUB), pl.ds(start + t, 1)]
            q_t, b_t = rows(q_ref, start + t, 1), rows(b_ref, start + t, 1)
            return dk_a + col * q_t * masked_exp(b_t - b_i)

        return (jax.lax.fori_loop(0, SUB, diag_dq, dq_i),
                jax.lax.fori_loop(0, SUB, diag_dk, dk_i))

    return diag.choose(b_i, b_r, factored, exact, dq_i, dk_i)


def _chunk_specs(Dk, Dv):
    sq = pl.squeezed
    keys = pl.BlockSpec((sq, C, sq, Dk), lambda b, h, c: (b, c, h, 0))
    values = pl.BlockSpec((sq, C, sq, Dv), lambda b, h, c: (b, c, h, 0))
    flags = pl.BlockSpec((sq, C), lambda b, h, c: (b, c))
    state = pl.BlockSpec((sq, sq, sq, Dk, Dv), lambda b, h, c: (b, h, c, 0, 0))
    scores = pl.BlockSpec((sq, sq, sq, C, C), lambda b, h, c: (b, h, c, 0, 0))
    return keys, values, flags, state, scores


def _scores_shape(B, H, Tp):
    return jax.ShapeDtypeStruct((B, H, Tp // C, C, C), F32)


def chunk_outputs(q, k, v, b, runs, carry_in, h, *, scale, interpret, num_warps=4, num_stages=1):
    """o [B, Tp, H, Dv] from the chunk start states h [B, H, NT, Dk, Dv], and the in-chunk
    scores A [B, H, NT, C, C] (fp32, unscaled, zero above the diagonal) for the backward."""
    B, Tp, H, Dk = q.shape
    Dv = v.shape[-1]
    keys, values, flags, state, scores = _chunk_specs(Dk, Dv)
    return pl.pallas_call(
        functools.partial(_output_kernel, scale=scale, cd=compute_dtype(q.dtype)),
        grid=(B, H, Tp // C),
        out_shape=(jax.ShapeDtypeStruct((B, Tp, H, Dv), v.dtype), _scores_shape(B, H, Tp)),
        in_specs=[keys, keys, values, keys, flags, flags, state], out_specs=(values, scores),
        compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
        name="gla_chunk_outputs",
    )(q, k, v, b, runs, carry_in, h)


def chunk_score_grads(v, runs, do, *, scale, interpret, num_warps=4):
    """dA = scale * do v^T on causal same-segment pairs [B, H, NT, C, C], and dA transposed."""
    B, Tp, H, Dv = v.shape
    _, values, flags, _, scores = _chunk_specs(Dv, Dv)
    return pl.pallas_call(
        functools.partial(_dscores_kernel, scale=scale, cd=compute_dtype(v.dtype)),
        grid=(B, H, Tp // C), out_shape=(_scores_shape(B, H, Tp),) * 2,
        in_specs=[values, flags, values], out_specs=(scores, scores),
        compiler_params=compiler_params(num_warps), interpret=interpret,
        name="gla_chunk_score_grads",
    )(v, runs, do)


def chunk_grads(q, k, v, b, carry_in, in_last, h, ds, do, a, da, dat, *, scale, interpret,
                num_warps=4, num_stages=1):
    """dq, dk (input dtype), dv, and db (fp32, w.r.t. the in-chunk cumulative decay)."""
    B, Tp, H, Dk = q.shape
    Dv = v.shape[-1]
    keys, values, flags, state, scores = _chunk_specs(Dk, Dv)
    # sum_v h * ds per chunk: the gradient of the start state's decay through the chunk,
    # one cheap XLA reduction instead of two [Dk, Dv] fp32 tiles per program
    hds = jnp.sum(h.astype(F32) * ds.astype(F32), axis=-1)
    row = pl.BlockSpec((pl.squeezed, pl.squeezed, pl.squeezed, Dk), lambda b, h, c: (b, h, c, 0))
    dq, dk, db, dv = pl.pallas_call(
        functools.partial(grads_kernel, scale=scale, cd=compute_dtype(q.dtype)),
        grid=(B, H, Tp // C),
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(q.shape, F32), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        in_specs=[keys, keys, values, keys, flags, flags, state, state, row, values,
                  scores, scores, scores],
        out_specs=(keys, keys, keys, values),
        compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
        name="gla_chunk_grads",
    )(q, k, v, b, carry_in, in_last, h, ds, hds, do, a, da, dat)
    return dq, dk, dv, db

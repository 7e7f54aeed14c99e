"""Pallas (Triton) kernels for chunked GLA: forward, state recompute, backward.

One program per (batch row, head, block of Dv) walks the chunks in order, carrying the
fp32 [Dk, BV] state in registers. Inside a chunk of 64 tokens the scores
A[t, s] = sum_d q_t[d] k_s[d] exp(b_t[d] - b_s[d]) (b: in-chunk cumulative log decay) are
built per 16-token sub-chunk: blocks below the diagonal factor the decay through the
sub-chunk boundary (both factors <= 1, so tensor-core matmuls), diagonal blocks form
each exp(b_t - b_s <= 0) exactly. No exp of a positive number is ever taken, so decays
down to g = -20 per token stay finite.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention._pallas_common import (
    F32, SUB, compiler_params, compute_dtype, iota, mm, row_as_column, rows)

C = 64
N_SUB = C // SUB


def _masked_exp(x):
    return jnp.exp(jnp.minimum(x, 0.0))


def _prev_run(r_ref, base):
    """Run index of the token before the chunk (0 before the first chunk)."""
    before = r_ref[pl.ds(jnp.maximum(base - 1, 0), 1)]
    return jnp.where(base > 0, jnp.max(before), 0)


def _diag_block(q_i, b_i, r_i, k_ref, b_ref, r_ref, start):
    """Exact scores of one 16x16 diagonal block, one key column at a time."""
    t = iota(SUB)
    cols = iota(SUB, 1, (SUB, SUB))

    def column(j, a):
        k_j = rows(k_ref, start + j, 1)
        b_j = rows(b_ref, start + j, 1)
        ok = (t >= j) & (r_i == jnp.max(r_ref[pl.ds(start + j, 1)]))
        col = jnp.where(ok, jnp.sum(q_i * k_j * _masked_exp(b_i - b_j), axis=1), 0.0)
        return a + jnp.where(cols == j, col[:, None], 0.0)

    return jax.lax.fori_loop(0, SUB, column, jnp.zeros((SUB, SUB), F32))


def _chunk_state_update(S, k, v, b, r, b_last, last, prev, cd):
    k_dec = k * _masked_exp(b_last - b) * (r == last)[:, None]
    kept = jnp.where(last == prev, row_as_column(jnp.exp(b_last)) * S, 0.0)
    return kept + mm(k_dec, v, cd, trans_a=True)


def _forward_kernel(q_ref, k_ref, v_ref, b_ref, r_ref, h0_ref, *out_refs, scale, n_chunks, cd,
                    emit_output):
    if emit_output:
        o_ref, ht_ref = out_refs
    else:
        (h_ref,) = out_refs
    s_idx = iota(C)

    def chunk(c, S):
        base = c * C
        prev = _prev_run(r_ref, base)
        r = r_ref[pl.ds(base, C)]
        last = jnp.max(r)
        k, v, b = rows(k_ref, base, C), rows(v_ref, base, C), rows(b_ref, base, C)
        b_last = rows(b_ref, base + C - 1, 1)
        if not emit_output:
            h_ref[c] = S
            return _chunk_state_update(S, k, v, b, r, b_last, last, prev, cd)
        for i in range(N_SUB):
            start = base + i * SUB
            q_i, b_i = rows(q_ref, start, SUB), rows(b_ref, start, SUB)
            r_i = r_ref[pl.ds(start, SUB)]
            o_i = mm(q_i * jnp.exp(b_i) * (r_i == prev)[:, None], S, cd)
            if i > 0:  # keys of earlier sub-chunks, decay split at the sub-chunk boundary
                b_ref_row = rows(b_ref, start - 1, 1)
                k_off = jnp.where((s_idx < i * SUB)[:, None], k * _masked_exp(b_ref_row - b), 0.0)
                a = mm(q_i * _masked_exp(b_i - b_ref_row), k_off, cd, trans_b=True)
                a = jnp.where(r_i[:, None] == r[None, :], a, 0.0)
                o_i += mm(a, v, cd)
            a_d = _diag_block(q_i, b_i, r_i, k_ref, b_ref, r_ref, start)
            o_i += mm(a_d, rows(v_ref, start, SUB), cd)
            o_ref[pl.ds(start, SUB), :] = (scale * o_i).astype(o_ref.dtype)
        return _chunk_state_update(S, k, v, b, r, b_last, last, prev, cd)

    S = jax.lax.fori_loop(0, n_chunks, chunk, h0_ref[...].astype(F32))
    if emit_output:
        ht_ref[...] = S


def _backward_kernel(q_ref, k_ref, v_ref, b_ref, r_ref, h_ref, do_ref, dht_ref,
                     dq_ref, dk_ref, dv_ref, db_ref, dh0_ref, *, scale, n_chunks, cd):
    t_idx = iota(C)
    sub_rows = iota(SUB, 0, (SUB, 1))
    sub_cols = iota(SUB, 1, (SUB, SUB))

    def chunk(step, dS):
        c = n_chunks - 1 - step
        base = c * C
        prev = _prev_run(r_ref, base)
        r = r_ref[pl.ds(base, C)]
        last = jnp.max(r)
        S = h_ref[c]
        q, k, v, b = (rows(x, base, C) for x in (q_ref, k_ref, v_ref, b_ref))
        do = rows(do_ref, base, C)
        b_last = rows(b_ref, base + C - 1, 1)
        extra = jnp.where(last == prev, jnp.sum(S * dS, axis=1)[None, :] * jnp.exp(b_last), 0.0)
        for i in range(N_SUB):
            start = base + i * SUB
            q_i, k_i, b_i = (rows(x, start, SUB) for x in (q_ref, k_ref, b_ref))
            v_i, do_i = rows(v_ref, start, SUB), rows(do_ref, start, SUB)
            r_i = r_ref[pl.ds(start, SUB)]
            in_last_i = (r_i == last)[:, None]
            # state paths: o <- S_prev (queries), S_next <- k, v (keys)
            dq_i = scale * mm(do_i, S, cd, trans_b=True) * jnp.exp(b_i) * (r_i == prev)[:, None]
            decay_to_end = _masked_exp(b_last - b_i) * in_last_i
            dk_i = mm(v_i, dS, cd, trans_b=True) * decay_to_end
            dv_i = mm(k_i * decay_to_end, dS, cd)
            extra += jnp.sum(k_i * dk_i, axis=0, keepdims=True)
            if i > 0:  # this sub-chunk's queries against earlier keys
                b_ref_row = rows(b_ref, start - 1, 1)
                k_off = jnp.where((t_idx < i * SUB)[:, None], k * _masked_exp(b_ref_row - b), 0.0)
                da = jnp.where(r_i[:, None] == r[None, :], scale * mm(do_i, v, cd, trans_b=True), 0.0)
                dq_i += mm(da, k_off, cd) * _masked_exp(b_i - b_ref_row)
            if i < N_SUB - 1:  # this sub-chunk's keys against later queries
                b_ref_row = rows(b_ref, start + SUB - 1, 1)
                q_off = jnp.where((t_idx >= (i + 1) * SUB)[:, None], q * _masked_exp(b - b_ref_row), 0.0)
                k_dec = k_i * _masked_exp(b_ref_row - b_i)
                same = r[:, None] == r_i[None, :]
                a = jnp.where(same, mm(q_off, k_dec, cd, trans_b=True), 0.0)
                dv_i += scale * mm(a, do, cd, trans_a=True)
                da = jnp.where(same, scale * mm(do, v_i, cd, trans_b=True), 0.0)
                dk_i += mm(da, q_off, cd, trans_a=True) * _masked_exp(b_ref_row - b_i)
            da_diag = scale * mm(do_i, v_i, cd, trans_b=True)

            def key(j, acc):  # exact diagonal block, one key j at a time
                dq_a, dk_a, dv_a = acc
                k_j, b_j = rows(k_ref, start + j, 1), rows(b_ref, start + j, 1)
                ok = ((sub_rows[:, 0] >= j) & (r_i == jnp.max(r_ref[pl.ds(start + j, 1)])))[:, None]
                e = jnp.where(ok, _masked_exp(b_i - b_j), 0.0)
                a_col = jnp.sum(q_i * k_j * e, axis=1, keepdims=True)
                da_col = jnp.sum(jnp.where(sub_cols == j, da_diag, 0.0), axis=1, keepdims=True)
                dq_a += da_col * k_j * e
                at_j = sub_rows == j
                dk_a += jnp.where(at_j, jnp.sum(da_col * q_i * e, axis=0, keepdims=True), 0.0)
                dv_a += jnp.where(at_j, jnp.sum(a_col * do_i, axis=0, keepdims=True), 0.0)
                return dq_a, dk_a, dv_a

            dq_i, dk_i, dv_d = jax.lax.fori_loop(0, SUB, key, (dq_i, dk_i, jnp.zeros_like(dv_i)))
            dv_i += scale * dv_d
            db_i = q_i * dq_i - k_i * dk_i
            if i == N_SUB - 1:  # b_last feeds the state decay and every key's decay-to-end
                db_i += jnp.where(sub_rows == SUB - 1, extra, 0.0)
            dq_ref[pl.ds(start, SUB), :] = dq_i
            dk_ref[pl.ds(start, SUB), :] = dk_i
            db_ref[pl.ds(start, SUB), :] = db_i
            dv_ref[pl.ds(start, SUB), :] = dv_i.astype(dv_ref.dtype)
        qg = q * jnp.exp(b) * (r == prev)[:, None]
        kept = jnp.where(last == prev, row_as_column(jnp.exp(b_last)) * dS, 0.0)
        return scale * mm(qg, do, cd, trans_a=True) + kept

    dh0_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, dht_ref[...].astype(F32))


def _specs(B, Tp, H, Dk, Dv, bv, n_chunks):
    sq = pl.squeezed
    qk = pl.BlockSpec((sq, Tp, sq, Dk), lambda b, h, j: (b, 0, h, 0))
    vv = pl.BlockSpec((sq, Tp, sq, bv), lambda b, h, j: (b, 0, h, j))
    runs = pl.BlockSpec((sq, Tp), lambda b, h, j: (b, 0))
    state = pl.BlockSpec((sq, sq, Dk, bv), lambda b, h, j: (b, h, 0, j))
    states = pl.BlockSpec((sq, sq, n_chunks, Dk, bv), lambda b, h, j: (b, h, 0, 0, j))
    partial = pl.BlockSpec((sq, sq, Tp, sq, Dk), lambda b, h, j: (j, b, 0, h, 0))
    return qk, vv, runs, state, states, partial


def gla_forward(q, k, v, b, runs, h0, *, scale, block_v, emit_output, interpret, num_warps=4):
    """o [B,Tp,H,Dv] and final state, or (emit_output=False) the per-chunk start states."""
    B, Tp, H, Dk = q.shape
    Dv = v.shape[-1]
    n_chunks = Tp // C
    qk, vv, rs, state, states, _ = _specs(B, Tp, H, Dk, Dv, block_v, n_chunks)
    if emit_output:
        out_shape = (jax.ShapeDtypeStruct((B, Tp, H, Dv), v.dtype),
                     jax.ShapeDtypeStruct((B, H, Dk, Dv), F32))
        out_specs = (vv, state)
    else:
        out_shape = jax.ShapeDtypeStruct((B, H, n_chunks, Dk, Dv), F32)
        out_specs = states
    kernel = functools.partial(_forward_kernel, scale=scale, n_chunks=n_chunks,
                               cd=compute_dtype(q.dtype), emit_output=emit_output)
    return pl.pallas_call(
        kernel, grid=(B, H, Dv // block_v), out_shape=out_shape,
        in_specs=[qk, qk, vv, qk, rs, state], out_specs=out_specs,
        compiler_params=compiler_params(num_warps), interpret=interpret,
        name="gla_fwd" if emit_output else "gla_states",
    )(q, k, v, b, runs, h0)


def gla_backward(q, k, v, b, runs, h, do, dht, *, scale, block_v, interpret, num_warps=4):
    """Partial (per Dv block) dq, dk, db, plus dv and d initial_state."""
    B, Tp, H, Dk = q.shape
    Dv = v.shape[-1]
    n_chunks = Tp // C
    nv = Dv // block_v
    qk, vv, rs, state, states, partial = _specs(B, Tp, H, Dk, Dv, block_v, n_chunks)
    part = jax.ShapeDtypeStruct((nv, B, Tp, H, Dk), F32)
    kernel = functools.partial(_backward_kernel, scale=scale, n_chunks=n_chunks, cd=compute_dtype(q.dtype))
    return pl.pallas_call(
        kernel, grid=(B, H, nv),
        out_shape=(part, part, jax.ShapeDtypeStruct((B, Tp, H, Dv), v.dtype), part,
                   jax.ShapeDtypeStruct((B, H, Dk, Dv), F32)),
        in_specs=[qk, qk, vv, qk, rs, states, vv, state],
        out_specs=(partial, partial, vv, partial, state),
        compiler_params=compiler_params(num_warps), interpret=interpret, name="gla_bwd",
    )(q, k, v, b, runs, h, do, dht)

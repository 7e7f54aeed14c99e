"""Pallas (Triton) backward kernels of chunked KDA (see _kda_forward for the chunk form).

Three passes after the forward's `prepare` and `states` are recomputed:
  `local_dv`  (parallel)   du_local = scale A_qk^T do
  `dstates`   (sequential, reverse; per (batch, head, Dv block)) with dS the cotangent of the
              chunk's end state: du = du_local + k_dec dS, stored with dS, and
              dS_prev = diag(exp(b_last)) dS + scale (q exp(b))^T do - w^T du
  `grads`     (parallel)   every input cotangent of one chunk from du, dS, S, u:
              through u = T diag(beta) (v - (k exp(b)) S):  du' = T^T du,
              dv = beta du',  d(k exp(b)) = -beta du' S^T,  dA_kk = -(du' u^T) (strict lower)
The cotangent of b (in-chunk cumulative log decay) is returned; g's follows by autodiff.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention._kda_chunk_math import (
    C, chunk_runs, dot, load, load_cols, masked_exp, same_run, scores, scores_bwd)
from pallas_kernels.linear_attention._kda_forward import Specs, _call
from pallas_kernels.linear_attention._pallas_common import F32, iota, row_as_column


def _local_dv_kernel(q_ref, k_ref, b_ref, r_ref, do_ref, dv_ref, *, scale, cd, block_v):
    r, _, _ = chunk_runs(r_ref, pl.program_id(2) * C)
    a_qk = scores(load(q_ref), load(k_ref), load(b_ref), k_ref, b_ref, same_run(r), False, cd)
    for j in range(dv_ref.shape[-1] // block_v):
        dv_ref[:, pl.ds(j * block_v, block_v)] = scale * dot(
            a_qk, load_cols(do_ref, j, block_v), cd, trans_a=True)


def _dstates_kernel(q_ref, k_ref, b_ref, r_ref, w_ref, dvl_ref, do_ref, dht_ref,
                    dh_ref, du_ref, dh0_ref, *, scale, n_chunks, cd):
    def chunk(step, dS):
        c = n_chunks - 1 - step
        base = c * C
        r, prev, last = chunk_runs(r_ref, base)
        dh_ref[c] = dS
        b, b_last = load(b_ref, base, C), load(b_ref, base + C - 1, 1)
        k_dec = jnp.where((r == last)[:, None], load(k_ref, base, C) * masked_exp(b_last - b), 0.0)
        du = load(dvl_ref, base, C) + dot(k_dec, dS)
        du_ref[pl.ds(base, C), :] = du
        q_dec = jnp.where((r == prev)[:, None], load(q_ref, base, C) * jnp.exp(b), 0.0)
        kept = jnp.where(last == prev, row_as_column(jnp.exp(b_last)) * dS, 0.0)
        return (kept + scale * dot(q_dec, load(do_ref, base, C), cd, trans_a=True)
                - dot(load(w_ref, base, C), du, trans_a=True))

    dh0_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, load(dht_ref))


def _grads_kernel(q_ref, k_ref, v_ref, b_ref, beta_ref, r_ref, h_ref, dh_ref, u_ref, du_ref,
                  do_ref, t_ref, dq_ref, dk_ref, dv_ref, db_ref, dbeta_ref, *, scale, cd, block_v):
    r, prev, last = chunk_runs(r_ref, pl.program_id(2) * C)
    same = same_run(r)
    carry_in, in_last = (r == prev)[:, None], (r == last)[:, None]
    q, k, b = load(q_ref), load(k_ref), load(b_ref)
    beta = load(beta_ref)[:, None]
    b_last = load(b_ref, C - 1, 1)
    exp_b = jnp.exp(b)
    t = load(t_ref)

    # Every Dv-dependent product, one block of Dv columns at a time (S, dS: [Dk, block_v]).
    dq_state = jnp.zeros(q.shape, F32)   # do S^T
    du_end = jnp.zeros(k.shape, F32)     # u dS^T: cotangent of k exp(b_last - b)
    kept = jnp.zeros((1, k.shape[1]), F32)  # sum_v S * dS
    da_qk = jnp.zeros((C, C), F32)       # do u^T
    du_s = jnp.zeros(k.shape, F32)       # T^T du S^T
    dm = jnp.zeros((C, C), F32)          # T^T du u^T
    dbeta = jnp.zeros((C, 1), F32)
    for j in range(dv_ref.shape[-1] // block_v):
        S, dS = load_cols(h_ref, j, block_v), load_cols(dh_ref, j, block_v)
        u, do = load_cols(u_ref, j, block_v), load_cols(do_ref, j, block_v)
        dq_state += dot(do, S, cd, trans_b=True)
        du_end += dot(u, dS, trans_b=True)
        kept += jnp.sum(S * dS, axis=1)[None, :]
        da_qk += dot(do, u, cd, trans_b=True)
        du_t = dot(t, load_cols(du_ref, j, block_v), trans_a=True)
        du_s += dot(du_t, S, trans_b=True)
        dm -= dot(du_t, u, trans_b=True)
        dbeta += jnp.sum(du_t * load_cols(v_ref, j, block_v), axis=1, keepdims=True)
        dv_ref[:, pl.ds(j * block_v, block_v)] = beta * du_t

    # o += scale (q exp(b)) S
    dq = jnp.where(carry_in, scale * dq_state * exp_b, 0.0)
    # S' = diag(exp(b_last)) S + (k exp(b_last - b))^T u
    dk = jnp.where(in_last, du_end * masked_exp(b_last - b), 0.0)
    db = -k * dk
    db_last = jnp.sum(k * dk, axis=0, keepdims=True)
    db_last += jnp.where(last == prev, kept * jnp.exp(b_last), 0.0)
    # o += scale A_qk u
    dq_s, dk_s = scores_bwd(jnp.where(same, scale * da_qk, 0.0), q, k, b, k_ref, b_ref, False, cd)
    dq += dq_s
    dk += dk_s
    db += q * dq - k * dk_s
    # u = T diag(beta) (v - (k exp(b)) S), T = (I + diag(beta) A_kk)^-1
    k_dec = jnp.where(carry_in, k * exp_b, 0.0)
    d_kdec = jnp.where(carry_in, -beta * du_s, 0.0)
    dk += d_kdec * exp_b
    db += k_dec * d_kdec
    a_kk = scores(k, k, b, k_ref, b_ref, same, True, cd)
    dm = jnp.where(same, dm, 0.0)
    dbeta += jnp.sum(dm * a_kk, axis=1, keepdims=True) - jnp.sum(du_s * k_dec, axis=1, keepdims=True)
    dk_q, dk_k = scores_bwd(beta * dm, k, k, b, k_ref, b_ref, True, cd)
    dk += dk_q + dk_k
    db += k * (dk_q - dk_k)
    db += jnp.where(iota(C, 0, (C, 1)) == C - 1, db_last, 0.0)
    dq_ref[...], dk_ref[...], db_ref[...] = dq, dk, db
    dbeta_ref[...] = dbeta.reshape(C)


def local_dv(q, k, b, runs, do, *, scale, block_v, cd, interpret):
    B, Tp, H, Dk = q.shape
    Dv = do.shape[-1]
    sp = Specs(Tp, Dk, Dv)
    kernel = functools.partial(_local_dv_kernel, scale=scale, cd=cd, block_v=block_v)
    return _call(kernel, (B, H, sp.n),
                 [sp.chunk(Dk), sp.chunk(Dk), sp.chunk(Dk), sp.runs, sp.chunk(Dv)],
                 sp.chunk(Dv), jax.ShapeDtypeStruct((B, Tp, H, Dv), F32),
                 interpret, "kda_local_dv")(q, k, b, runs, do)


def dstates(q, k, b, runs, w, dvl, do, dht, *, scale, block_v, cd, interpret):
    """(per-chunk end-state cotangents [B,H,n,Dk,Dv], du [B,Tp,H,Dv], d initial state)."""
    B, Tp, H, Dk = q.shape
    Dv = do.shape[-1]
    sp = Specs(Tp, Dk, Dv)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, F32)
    kernel = functools.partial(_dstates_kernel, scale=scale, n_chunks=sp.n, cd=cd)
    return _call(kernel, (B, H, Dv // block_v),
                 [sp.seq(Dk), sp.seq(Dk), sp.seq(Dk), sp.runs, sp.seq(Dk), sp.seq_v(block_v),
                  sp.seq_v(block_v), sp.state(block_v)],
                 (sp.states(block_v), sp.seq_v(block_v), sp.state(block_v)),
                 (f32(B, H, sp.n, Dk, Dv), f32(B, Tp, H, Dv), f32(B, H, Dk, Dv)),
                 interpret, "kda_dstates")(q, k, b, runs, w, dvl, do, dht)


def grads(q, k, v, b, beta, runs, h, dh, u, du, do, t, *, scale, block_v, cd, interpret):
    """fp32 (dq, dk, dv, db, dbeta) of the normalised q/k, v, cumulative decay b and beta."""
    B, Tp, H, Dk = q.shape
    Dv = v.shape[-1]
    sp = Specs(Tp, Dk, Dv)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, F32)
    kernel = functools.partial(_grads_kernel, scale=scale, cd=cd, block_v=block_v)
    return _call(kernel, (B, H, sp.n),
                 [sp.chunk(Dk), sp.chunk(Dk), sp.chunk(Dv), sp.chunk(Dk), sp.chunk_beta, sp.runs,
                  sp.chunk_state, sp.chunk_state, sp.chunk(Dv), sp.chunk(Dv), sp.chunk(Dv),
                  sp.chunk_inverse],
                 (sp.chunk(Dk), sp.chunk(Dk), sp.chunk(Dv), sp.chunk(Dk), sp.chunk_beta),
                 (f32(B, Tp, H, Dk), f32(B, Tp, H, Dk), f32(B, Tp, H, Dv), f32(B, Tp, H, Dk),
                  f32(B, Tp, H)),
                 interpret, "kda_grads")(q, k, v, b, beta, runs, h, dh, u, du, do, t)

"""Pallas (Triton) forward kernels of chunked KDA (WY / UT-transform form).

Per 64-token chunk with b the in-chunk cumulative log decay and S the state at its start:
  A_kk[t, s] = beta_t sum_d k_t k_s exp(b_t - b_s)  (s < t, same segment),  T = (I + A_kk)^-1
  w  = T diag(beta) (k * exp(b))   (only tokens still in the segment S belongs to)
  u0 = T diag(beta) v,   u = u0 - w S
  S' = diag(exp(b_last)) S + (k * exp(b_last - b))^T u      (S kept only if no reset)
  o  = scale * ((q * exp(b)) S + A_qk u),   A_qk: causal decayed q.k scores
Three passes: `prepare` (parallel over chunks: T, w, u0), `states` (sequential over chunks,
one program per (batch, head, Dv block): S per chunk and u) and `output` (parallel).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention._kda_chunk_math import (
    C, chunk_runs, dot, load, load_cols, masked_exp, same_run, scores, unit_lower_inverse)
from pallas_kernels.linear_attention._pallas_common import F32, compiler_params, row_as_column


def _prepare_kernel(k_ref, v_ref, b_ref, beta_ref, r_ref, w_ref, u0_ref, t_ref, *, cd):
    r, prev, _ = chunk_runs(r_ref, pl.program_id(2) * C)
    k, v, b = load(k_ref), load(v_ref), load(b_ref)
    beta = load(beta_ref)[:, None]
    a_kk = beta * scores(k, k, b, k_ref, b_ref, same_run(r), True, cd)
    t = unit_lower_inverse(a_kk)
    carry_in = (r == prev)[:, None]
    w_ref[...] = dot(t, jnp.where(carry_in, beta * k * jnp.exp(b), 0.0))
    u0_ref[...] = dot(t, beta * v)
    t_ref[...] = t


def _states_kernel(k_ref, b_ref, r_ref, w_ref, u0_ref, h0_ref, h_ref, u_ref, ht_ref, *, n_chunks):
    def chunk(c, S):
        base = c * C
        r, prev, last = chunk_runs(r_ref, base)
        h_ref[c] = S
        u = load(u0_ref, base, C) - dot(load(w_ref, base, C), S)
        u_ref[pl.ds(base, C), :] = u
        b, b_last = load(b_ref, base, C), load(b_ref, base + C - 1, 1)
        k_dec = jnp.where((r == last)[:, None], load(k_ref, base, C) * masked_exp(b_last - b), 0.0)
        kept = jnp.where(last == prev, row_as_column(jnp.exp(b_last)) * S, 0.0)
        return kept + dot(k_dec, u, trans_a=True)

    ht_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, load(h0_ref))


def _output_kernel(q_ref, k_ref, b_ref, r_ref, h_ref, u_ref, o_ref, *, scale, cd, block_v):
    r, prev, _ = chunk_runs(r_ref, pl.program_id(2) * C)
    q, k, b = load(q_ref), load(k_ref), load(b_ref)
    a_qk = scores(q, k, b, k_ref, b_ref, same_run(r), False, cd)
    q_dec = jnp.where((r == prev)[:, None], q * jnp.exp(b), 0.0)
    for j in range(o_ref.shape[-1] // block_v):
        o = dot(q_dec, load_cols(h_ref, j, block_v)) + dot(a_qk, load_cols(u_ref, j, block_v))
        o_ref[:, pl.ds(j * block_v, block_v)] = (scale * o).astype(o_ref.dtype)


class Specs:
    """BlockSpecs over [B, Tp, H, D] token arrays, [B, Tp] run ids, [B, H, Tp, C] per-chunk
    inverses and [B, H, n, Dk, Dv] per-chunk states, for a chunk grid (b, h, c) or a
    sequential grid (b, h, Dv block)."""

    def __init__(self, Tp, Dk, Dv):
        sq = pl.squeezed
        self.Tp, self.Dk, self.Dv, self.n = Tp, Dk, Dv, Tp // C
        self.chunk = lambda d: pl.BlockSpec((sq, C, sq, d), lambda b, h, c: (b, c, h, 0))
        self.chunk_beta = pl.BlockSpec((sq, C, sq), lambda b, h, c: (b, c, h))
        self.runs = pl.BlockSpec((sq, Tp), lambda b, h, _: (b, 0))
        self.chunk_inverse = pl.BlockSpec((sq, sq, C, C), lambda b, h, c: (b, h, c, 0))
        self.chunk_state = pl.BlockSpec((sq, sq, sq, Dk, Dv), lambda b, h, c: (b, h, c, 0, 0))
        self.seq = lambda d: pl.BlockSpec((sq, Tp, sq, d), lambda b, h, j: (b, 0, h, 0))
        self.seq_v = lambda bv: pl.BlockSpec((sq, Tp, sq, bv), lambda b, h, j: (b, 0, h, j))
        self.state = lambda bv: pl.BlockSpec((sq, sq, Dk, bv), lambda b, h, j: (b, h, 0, j))
        self.states = lambda bv: pl.BlockSpec((sq, sq, self.n, Dk, bv),
                                              lambda b, h, j: (b, h, 0, 0, j))


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret, name, num_warps=4):
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                          out_shape=out_shape, compiler_params=compiler_params(num_warps),
                          interpret=interpret, name=name)


def prepare(k, v, b, beta, runs, *, cd, interpret):
    """(w [B,Tp,H,Dk], u0 [B,Tp,H,Dv], T [B,H,Tp,C]) all fp32."""
    B, Tp, H, Dk = k.shape
    Dv = v.shape[-1]
    sp = Specs(Tp, Dk, Dv)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, F32)
    return _call(functools.partial(_prepare_kernel, cd=cd), (B, H, sp.n),
                 [sp.chunk(Dk), sp.chunk(Dv), sp.chunk(Dk), sp.chunk_beta, sp.runs],
                 (sp.chunk(Dk), sp.chunk(Dv), sp.chunk_inverse),
                 (f32(B, Tp, H, Dk), f32(B, Tp, H, Dv), f32(B, H, Tp, C)),
                 interpret, "kda_prepare")(k, v, b, beta, runs)


def states(k, b, runs, w, u0, h0, *, block_v, interpret):
    """(per-chunk start states h [B,H,n,Dk,Dv], u [B,Tp,H,Dv], final state) all fp32."""
    B, Tp, H, Dk = k.shape
    Dv = u0.shape[-1]
    sp = Specs(Tp, Dk, Dv)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, F32)
    return _call(functools.partial(_states_kernel, n_chunks=sp.n), (B, H, Dv // block_v),
                 [sp.seq(Dk), sp.seq(Dk), sp.runs, sp.seq(Dk), sp.seq_v(block_v),
                  sp.state(block_v)],
                 (sp.states(block_v), sp.seq_v(block_v), sp.state(block_v)),
                 (f32(B, H, sp.n, Dk, Dv), f32(B, Tp, H, Dv), f32(B, H, Dk, Dv)),
                 interpret, "kda_states")(k, b, runs, w, u0, h0)


def output(q, k, b, runs, h, u, *, scale, out_dtype, block_v, cd, interpret):
    B, Tp, H, Dk = q.shape
    Dv = u.shape[-1]
    sp = Specs(Tp, Dk, Dv)
    kernel = functools.partial(_output_kernel, scale=scale, cd=cd, block_v=block_v)
    return _call(kernel, (B, H, sp.n),
                 [sp.chunk(Dk), sp.chunk(Dk), sp.chunk(Dk), sp.runs, sp.chunk_state,
                  sp.chunk(Dv)],
                 sp.chunk(Dv), jax.ShapeDtypeStruct((B, Tp, H, Dv), out_dtype),
                 interpret, "kda_output")(q, k, b, runs, h, u)

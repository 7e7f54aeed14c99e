"""The GLA chunk kernels split the way fla splits them: more, smaller programs.

The fused layout (_gla_chunks) runs one program per chunk for everything a chunk needs;
here each part gets the grid that fits it:
  forward   scores A per chunk (the sub-chunk loop, all key channels), then
            o = scale (q exp(b) ci S + A v) per (chunk, block of value channels): two
            dense [64, .] matmuls, no loop;
  backward  dv = (k exp(b_last - b) il) dS + scale A^T do per (chunk, value block), dense;
            dq, dk, db per (chunk, block of key channels): the fused gradient kernel's
            body, which only ever combines channels of one key block.
The same results as the fused layout up to rounding: sums run in another order, and a
key block decides alone whether its diagonal blocks factor (`Tiling(split=1)` picks this
layout).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention._gla_chunks import (
    _flags, _scores_shape, grads_kernel, score_rows, store_score_rows)
from pallas_kernels.linear_attention._inputs import CHUNK as C
from pallas_kernels.linear_attention._pallas_common import (
    F32, SUB, compiler_params, compute_dtype, masked_exp, mm, rows)

N_SUB = C // SUB
_sq = pl.squeezed


def _scores_kernel(q_ref, k_ref, b_ref, r_ref, a_ref, *, cd):
    k_all, b_all, r_all = rows(k_ref, 0, C), rows(b_ref, 0, C), r_ref[...]

    def sub_chunk(i, carry):
        start = pl.multiple_of(i * SUB, SUB)
        q_i, b_i = rows(q_ref, start, SUB), rows(b_ref, start, SUB)
        a_off, a_d = score_rows(q_i, b_i, _flags(r_ref, start, SUB), k_all, b_all, r_all,
                                k_ref, b_ref, r_ref, start, cd)
        store_score_rows(a_ref, start, a_off, a_d)
        return carry

    jax.lax.fori_loop(0, N_SUB, sub_chunk, 0)


def _outputs_kernel(q_ref, b_ref, ci_ref, h_ref, a_ref, v_ref, o_ref, *, scale, cd):
    q, b = rows(q_ref, 0, C), rows(b_ref, 0, C)
    qg = q * jnp.exp(b) * ci_ref[...].astype(F32)[:, None]
    o = mm(qg, h_ref[...], cd) + mm(a_ref[...], v_ref[...], cd)
    o_ref[...] = (scale * o).astype(o_ref.dtype)


def _value_grads_kernel(k_ref, b_ref, il_ref, ds_ref, a_ref, do_ref, dv_ref, *, scale, cd):
    k, b = rows(k_ref, 0, C), rows(b_ref, 0, C)
    b_last = rows(b_ref, C - 1, 1)
    kg = k * masked_exp(b_last - b) * il_ref[...].astype(F32)[:, None]
    dv = mm(kg, ds_ref[...], cd) + scale * mm(a_ref[...], do_ref[...], cd, trans_a=True)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(block):
    """Block specs on the grid (b, h, chunk, j), j walking blocks of `block` channels."""
    return dict(
        whole=lambda d: pl.BlockSpec((_sq, C, _sq, d), lambda b, h, c, j: (b, c, h, 0)),
        rows=pl.BlockSpec((_sq, C, _sq, block), lambda b, h, c, j: (b, c, h, j)),
        flags=pl.BlockSpec((_sq, C), lambda b, h, c, j: (b, c)),
        scores=pl.BlockSpec((_sq, _sq, _sq, C, C), lambda b, h, c, j: (b, h, c, 0, 0)),
        # a chunk's state [Dk, Dv]: a block of value columns / of key rows
        state_cols=lambda dk: pl.BlockSpec((_sq, _sq, _sq, dk, block),
                                           lambda b, h, c, j: (b, h, c, 0, j)),
        state_rows=lambda dv: pl.BlockSpec((_sq, _sq, _sq, block, dv),
                                           lambda b, h, c, j: (b, h, c, j, 0)),
        key_row=pl.BlockSpec((_sq, _sq, _sq, block), lambda b, h, c, j: (b, h, c, j)),
    )


def chunk_outputs(q, k, v, b, runs, carry_in, h, *, scale, block_v, interpret, num_warps=4):
    """Same contract as _gla_chunks.chunk_outputs: (o, A)."""
    B, Tp, H, Dk = q.shape
    Dv = v.shape[-1]
    cd = compute_dtype(q.dtype)
    s = _specs(block_v)
    one = _specs(Dk)  # the scores kernel: a single block of all key channels
    a = pl.pallas_call(
        functools.partial(_scores_kernel, cd=cd), grid=(B, H, Tp // C, 1),
        out_shape=_scores_shape(B, H, Tp),
        in_specs=[one["rows"], one["rows"], one["rows"], one["flags"]],
        out_specs=one["scores"], compiler_params=compiler_params(num_warps),
        interpret=interpret, name="gla_chunk_scores",
    )(q, k, b, runs)
    o = pl.pallas_call(
        functools.partial(_outputs_kernel, scale=scale, cd=cd),
        grid=(B, H, Tp // C, Dv // block_v),
        out_shape=jax.ShapeDtypeStruct((B, Tp, H, Dv), v.dtype),
        in_specs=[s["whole"](Dk), s["whole"](Dk), s["flags"], s["state_cols"](Dk), s["scores"],
                  s["rows"]],
        out_specs=s["rows"], compiler_params=compiler_params(num_warps),
        interpret=interpret, name="gla_chunk_outputs_from_scores",
    )(q, b, carry_in, h, a, v)
    return o, a


def chunk_grads(q, k, v, b, carry_in, in_last, h, ds, do, a, da, dat, *, scale, block_k,
                block_v, interpret, num_warps=4):
    """Same contract as _gla_chunks.chunk_grads: dq, dk, dv, db."""
    B, Tp, H, Dk = q.shape
    Dv = v.shape[-1]
    cd = compute_dtype(q.dtype)
    sv, sk = _specs(block_v), _specs(block_k)
    dv = pl.pallas_call(
        functools.partial(_value_grads_kernel, scale=scale, cd=cd),
        grid=(B, H, Tp // C, Dv // block_v),
        out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
        in_specs=[sv["whole"](Dk), sv["whole"](Dk), sv["flags"], sv["state_cols"](Dk),
                  sv["scores"], sv["rows"]],
        out_specs=sv["rows"], compiler_params=compiler_params(num_warps),
        interpret=interpret, name="gla_chunk_value_grads",
    )(k, b, in_last, ds, a, do)
    hds = jnp.sum(h.astype(F32) * ds.astype(F32), axis=-1)  # as in _gla_chunks.chunk_grads
    # `a` is passed for the kernel's signature only: without a dv output it is not read
    dq, dk, db = pl.pallas_call(
        functools.partial(grads_kernel, scale=scale, cd=cd),
        grid=(B, H, Tp // C, Dk // block_k),
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(q.shape, F32)),
        in_specs=[sk["rows"], sk["rows"], sk["whole"](Dv), sk["rows"], sk["flags"], sk["flags"],
                  sk["state_rows"](Dv), sk["state_rows"](Dv), sk["key_row"], sk["whole"](Dv),
                  sk["scores"], sk["scores"], sk["scores"]],
        out_specs=(sk["rows"], sk["rows"], sk["rows"]),
        compiler_params=compiler_params(num_warps), interpret=interpret,
        name="gla_chunk_key_grads",
    )(q, k, v, b, carry_in, in_last, h, ds, hds, do, a, da, dat)
    return dq, dk, dv, db

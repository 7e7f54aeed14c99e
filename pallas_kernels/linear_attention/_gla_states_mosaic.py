"""The two sequential GLA kernels (_gla_states.py) as Mosaic GPU kernels for Hopper.

Same contracts as chunk_states / chunk_state_grads. One warpgroup per (batch row, head,
[BK, BV] state tile) keeps the fp32 tile in registers (the warpgroup-matmul accumulator)
and walks the chunks: TMA brings the coming chunks' rows into shared memory (STAGES
slots: up to three chunks ahead) while the current one is processed, the tile entering
each chunk leaves in the compute dtype through shared memory and TMA, and the chunk's
update X_dec^T Y is one warpgroup matmul with both operands in shared memory.

  forward  (toward_end): X = k, Y = v, X_dec = k exp(b_last - b) in_last
  backward (reverse):    X = q, Y = do, X_dec = scale q exp(b) carry_in
and, for both, S <- keep exp(b_last) S + X_dec^T Y, keep = carry_in at the chunk's last
token (that factor and b_last come per chunk from outside: [B, NT, H, Dk], 1/64 of b).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.linear_attention._inputs import CHUNK as C

BLOCK = 64  # state tile [BLOCK, BLOCK]; H200, (1, 32768, 32, 128): states 0.72 ms (128-wide key
# tiles: half the programs, 1.13 ms; 32-wide value tiles 1.09)
STAGES = 4  # chunks in flight through TMA: 0.72 ms (0.80 with 3, 0.89 with 2)
_F32 = jnp.float32
_WG = plgpu.Layout.WGMMA
_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a WGMMA-layout array
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column


def _smem(shape, dtype, swizzle_row=None):
    """Shared memory tiled and swizzled for its minor dimension (or that of a
    `swizzle_row`-element row: the two operands of one warpgroup matmul share a swizzle)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle((swizzle_row or shape[-1]) * itemsize * 8)
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)))


def _load(ref, layout=_WG):
    return plgpu.load(ref, layout=layout, optimized=False)


def _accumulate(init, a, b, interpret):
    """init + a @ b on the tensor cores (fp32 accumulator), a and b in shared memory."""
    if interpret:  # the interpreter cannot start an accumulator from a value
        def product(acc):
            plgpu.wgmma(acc, a, b)
            return acc[...]
        return init + pl.run_scoped(product, plgpu.ACC(init.shape, _F32))

    def update(acc):
        plgpu.wgmma(acc, a, b)
    return pl.run_state(update)(plgpu.ACC.init(init))


def _chunk_rows(b, carry_in):
    """Per chunk [B, NT, H, Dk] fp32: the state factor keep exp(b_last), and b_last."""
    last = b[:, C - 1::C]
    keep = carry_in[:, C - 1::C].astype(_F32)
    return keep[:, :, None, None] * jnp.exp(last), last


def _walk(x, y, b, flags, per_chunk, h0, *, toward_end, reverse, scale, block_k, block_v,
          stages, interpret, name):
    B, Tp, H, Dk = x.shape
    Dv = y.shape[-1]
    n_chunks = Tp // C
    cd = x.dtype
    bk, bv = block_k, block_v
    factors, last = per_chunk

    def body(x_ref, y_ref, b_ref, f_ref, d_ref, e_ref, h0_ref, states_ref, final_ref,
             x_s, y_s, b_s, f_s, d_s, e_s, xd_s, out_s, bars):
        kt, vt = lax.axis_index("k"), lax.axis_index("v")
        h, bi = lax.axis_index("h"), lax.axis_index("b")
        kcols, vcols = pl.ds(kt * bk, bk), pl.ds(vt * bv, bv)

        def chunk_at(i):
            return n_chunks - 1 - i if reverse else i

        def fetch(i, slot):
            n = chunk_at(i)
            tok = pl.ds(n * C, C)
            bar = bars.at[slot]
            plgpu.copy_gmem_to_smem(x_ref.at[bi, tok, h, kcols], x_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(y_ref.at[bi, tok, h, vcols], y_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(b_ref.at[bi, tok, h, kcols], b_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(f_ref.at[bi, tok], f_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(d_ref.at[bi, n, h, kcols], d_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(e_ref.at[bi, n, h, kcols], e_s.at[slot], bar)

        for i in range(min(stages - 1, n_chunks)):
            fetch(i, i)
        S0 = _load(h0_ref.at[bi, h, kcols, vcols])

        def step(i, S):
            slot = lax.rem(i, stages)
            plgpu.commit_smem()  # this warpgroup is done reading the slot refilled next

            @pl.when(i + stages - 1 < n_chunks)
            def _():
                fetch(i + stages - 1, lax.rem(i + stages - 1, stages))

            plgpu.barrier_wait(bars.at[slot])
            # the tile entering this chunk (the previous chunk's store has read out_s)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            out_s[...] = S.astype(cd)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_s, states_ref.at[bi, h, chunk_at(i), kcols, vcols])

            bb = _load(b_s.at[slot])
            if toward_end:
                expo = lax.broadcast_in_dim(_load(e_s.at[slot], _COL), (C, bk), [1]) - bb
            else:
                expo = bb
            flag = _load(f_s.at[slot], _ROW).astype(_F32)
            weight = jnp.exp(jnp.minimum(expo, 0.0)) * lax.broadcast_in_dim(flag, (C, bk), [0])
            xd_s[...] = (_load(x_s.at[slot]).astype(_F32) * (weight * scale)).astype(cd)
            plgpu.commit_smem()
            decay = lax.broadcast_in_dim(_load(d_s.at[slot], _ROW), (bk, bv), [0])
            return _accumulate(S * decay, xd_s.T, y_s.at[slot], interpret)

        S = lax.fori_loop(0, n_chunks, step, S0)
        final_ref.at[bi, h, kcols, vcols][...] = S
        plgpu.wait_smem_to_gmem(0)

    scratch = (
        _smem((stages, C, bk), cd),  # X rows
        _smem((stages, C, bv), cd),  # Y rows
        _smem((stages, C, bk), _F32),  # in-chunk cumulative log decay
        plgpu.SMEM((stages, C), jnp.int32),  # per-token flag
        plgpu.SMEM((stages, bk), _F32),  # per-chunk state factor
        plgpu.SMEM((stages, bk), _F32),  # per-chunk b_last
        _smem((C, bk), cd, swizzle_row=bv),  # X_dec (matmul operand with Y)
        _smem((bk, bv), cd),  # the tile entering the chunk, on its way out
        plgpu.Barrier(num_arrivals=6, num_barriers=stages),
    )
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                  approx_math=True)
    kernel = plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((B, H, n_chunks, Dk, Dv), cd),
                        jax.ShapeDtypeStruct((B, H, Dk, Dv), _F32)),
        grid=(Dk // bk, Dv // bv, H, B), grid_names=("k", "v", "h", "b"),
        scratch_types=scratch, compiler_params=params, kernel_name=name,
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    return kernel(x, y, b, flags, factors, last, h0.astype(_F32))


def chunk_states(k, v, b, in_last, carry_in, h0, *, interpret, block_k=BLOCK, block_v=BLOCK,
                 stages=STAGES):
    """States before every chunk [B, H, NT, Dk, Dv] (compute dtype) and the final fp32 state."""
    return _walk(k, v, b, in_last, _chunk_rows(b, carry_in), h0, toward_end=True,
                 reverse=False, scale=1.0, block_k=block_k, block_v=block_v, stages=stages,
                 interpret=interpret, name="gla_states_mosaic")


def chunk_state_grads(q, b, carry_in, do, dht, *, scale, interpret, block_k=BLOCK,
                      block_v=BLOCK, stages=STAGES):
    """Gradients w.r.t. the state after every chunk [B, H, NT, Dk, Dv] and w.r.t. h0 (fp32)."""
    return _walk(q, do, b, carry_in, _chunk_rows(b, carry_in), dht, toward_end=False,
                 reverse=True, scale=scale, block_k=block_k, block_v=block_v, stages=stages,
                 interpret=interpret, name="gla_state_grads_mosaic")

"""The two sequential GLA kernels (_gla_states.py) as Mosaic GPU kernels for Hopper.

Same contracts as chunk_states / chunk_state_grads there, on _mosaic_walk.chunk_walk:
one warpgroup per (batch row, head, [BK, BV] state tile) keeps the fp32 tile in
registers (the warpgroup-matmul accumulator), TMA keeps up to STAGES - 1 chunks in
flight, the tile entering each chunk leaves in the compute dtype through shared memory
and TMA, and the chunk's update X_dec^T Y is one warpgroup matmul with both operands in
shared memory.

  forward  (toward_end): X = k, Y = v, X_dec = k exp(b_last - b) in_last
  backward (reverse):    X = q, Y = do, X_dec = scale q exp(b) carry_in
and, for both, S <- keep exp(b_last) S + X_dec^T Y, keep = carry_in at the chunk's last
token (that factor and b_last come per chunk from outside: [B, NT, H, Dk], 1/64 of b).
"""
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.linear_attention._chunk_prep import state_factors
from pallas_kernels.linear_attention._inputs import CHUNK as C
from pallas_kernels.linear_attention._mosaic_common import (COL, F32, ROW, load, matmul, per_column,
                                                            per_row, smem)
from pallas_kernels.linear_attention._mosaic_walk import chunk_walk, publish, state_outputs

# chosen by measurement: docs/kernel_tuning.md, "GLA state walks on Mosaic GPU"
BLOCK = 64  # state tile [BLOCK, BLOCK] (128-wide key tiles: half the programs)
STAGES = 4  # chunks in flight through TMA


def _walk(x, y, b, flags, h0, factors, last, *, toward_end, reverse, scale, block_k, block_v,
          stages, interpret, name):
  B, Tp, H, Dk = x.shape
  cd = x.dtype
  bk, bv = block_k, block_v

  def step(slots, work, outs, where, n, S):
    x_s, y_s, b_s, f_s, d_s, e_s = slots
    xd_s, out_s = work
    bi, h, kcols, vcols = where
    publish(S, out_s, outs[0].at[bi, h, n, kcols, vcols])  # the tile entering the chunk
    bb = load(b_s)
    expo = per_column(load(e_s, COL), (C, bk)) - bb if toward_end else bb
    weight = jnp.exp(jnp.minimum(expo, 0.0)) * per_row(load(f_s, ROW).astype(F32), (C, bk))
    xd_s[...] = (load(x_s).astype(F32) * (weight * scale)).astype(cd)
    plgpu.commit_smem()
    decay = per_row(load(d_s, ROW), (bk, bv))
    return matmul(xd_s.T, y_s, (bk, bv), interpret, init=S * decay)

  return chunk_walk(
      [("keys", x), ("values", y), ("keys", b), ("flags", flags), ("chunk_keys", factors),
       ("chunk_keys", last)],
      h0,
      state_outputs(B, H, Tp // C, Dk, y.shape[-1], cd),
      step,
      block_k=bk,
      block_v=bv,
      stages=stages,
      reverse=reverse,
      scratch=(
          smem((C, bk), cd, swizzle_row=bv),  # X_dec (matmul operand with Y)
          smem((bk, bv), cd)),  # the tile entering the chunk, on its way out
      name=name,
      interpret=interpret)


def chunk_states(k, v, b, in_last, carry_in, h0, *, interpret, block_k=BLOCK, block_v=BLOCK,
                 stages=STAGES):
  """States before every chunk [B, H, NT, Dk, Dv] (compute dtype) and the final fp32 state."""
  return _walk(k, v, b, in_last, h0, state_factors(b, carry_in), b[:, C - 1::C], toward_end=True,
               reverse=False, scale=1.0, block_k=block_k, block_v=block_v, stages=stages,
               interpret=interpret, name="gla_states_mosaic")


def chunk_state_grads(q, b, carry_in, do, dht, *, scale, interpret, block_k=BLOCK, block_v=BLOCK,
                      stages=STAGES):
  """Gradients w.r.t. the state after every chunk [B, H, NT, Dk, Dv] and w.r.t. h0 (fp32)."""
  return _walk(q, do, b, carry_in, dht, state_factors(b, carry_in), b[:, C - 1::C],
               toward_end=False, reverse=True, scale=scale, block_k=block_k, block_v=block_v,
               stages=stages, interpret=interpret, name="gla_state_grads_mosaic")

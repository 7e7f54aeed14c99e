"""The two sequential KDA kernels (_kda_states.py) as Mosaic GPU kernels for Hopper.

Same contracts as chunk_states / chunk_state_grads there, on _mosaic_walk.chunk_walk:
one warpgroup per (batch row, head, block of value channels) keeps the whole [Dk, BV]
fp32 state in registers (the warpgroup-matmul accumulator), and every product is a
warpgroup matmul with both operands in shared memory:
  forward   v_new = u0 - w S;   S <- keep exp(b_last) S + kg^T v_new
  backward  dv_new = dv_local + kg dS;   dS <- keep exp(b_last) dS + scale qg^T do - w^T dv_new
The state (or its gradient) entering each chunk and v_new (dv_new) leave in the compute
dtype through shared memory and TMA, and are the operands of the next product too.
"""
from jax import ShapeDtypeStruct as Shape
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.linear_attention._chunk_prep import state_factors
from pallas_kernels.linear_attention._inputs import CHUNK as C
from pallas_kernels.linear_attention._mosaic_common import F32, ROW, load, matmul, per_row, smem
from pallas_kernels.linear_attention._mosaic_walk import chunk_walk, publish, state_outputs

MAX_DK = 128  # the [Dk, BV] fp32 state and a product of that size stay in registers
STAGES = 3  # chunks in flight through TMA (forward; the backward's slots are larger: 2)


def chunk_states(w, u0, kg, b, carry_in, h0, *, block_v, cd, interpret, stages=STAGES):
  """(start state of every chunk [B,H,n,Dk,Dv] (cd), v_new [B,Tp,H,Dv] (cd), final fp32
    state)."""
  B, Tp, H, Dk = w.shape
  Dv = u0.shape[-1]

  def step(slots, work, outs, where, n, S):
    w_s, u_s, kg_s, d_s = slots
    s_s, vn_s = work
    bi, h, _, vcols = where
    publish(S, s_s, outs[0].at[bi, h, n, :, vcols])
    vn = load(u_s).astype(F32) - matmul(w_s, s_s, (C, block_v), interpret)
    publish(vn, vn_s, outs[1].at[bi, pl.ds(n * C, C), h, vcols])
    decay = per_row(load(d_s, ROW), (Dk, block_v))
    return matmul(kg_s.T, vn_s, (Dk, block_v), interpret, init=S * decay)

  return chunk_walk([("keys", w), ("values", u0), ("keys", kg),
                     ("chunk_keys", state_factors(b, carry_in))], h0,
                    state_outputs(B, H, Tp // C, Dk, Dv, cd, Shape((B, Tp, H, Dv), cd)), step,
                    block_k=Dk, block_v=block_v, stages=stages, reverse=False, scratch=(smem(
                        (Dk, block_v), cd), smem(
                            (C, block_v), cd)), name="kda_states_mosaic", interpret=interpret)


def chunk_state_grads(qg, kg, w, b, carry_in, dv_local, do, dht, *, scale, block_v, cd, interpret,
                      stages=2):
  """(gradient of the end state of every chunk [B,H,n,Dk,Dv] (cd), total gradient of
    v_new [B,Tp,H,Dv] (cd), gradient of the initial state (fp32))."""
  B, Tp, H, Dk = w.shape
  Dv = do.shape[-1]

  def step(slots, work, outs, where, n, dS):
    qg_s, kg_s, w_s, d_s, dvl_s, do_s = slots
    ds_s, dvn_s, neg_dvn_s = work
    bi, h, _, vcols = where
    publish(dS, ds_s, outs[0].at[bi, h, n, :, vcols])
    dvn = load(dvl_s).astype(F32) + matmul(kg_s, ds_s, (C, block_v), interpret)
    publish(dvn, dvn_s, outs[1].at[bi, pl.ds(n * C, C), h, vcols])
    neg_dvn_s[...] = (-dvn).astype(cd)  # - w^T dv_new accumulated as w^T (-dv_new)
    plgpu.commit_smem()
    decay = per_row(load(d_s, ROW), (Dk, block_v))
    init = decay * dS + scale * matmul(qg_s.T, do_s, (Dk, block_v), interpret)
    return matmul(w_s.T, neg_dvn_s, (Dk, block_v), interpret, init=init)

  return chunk_walk([("keys", qg), ("keys", kg), ("keys", w),
                     ("chunk_keys", state_factors(b, carry_in)), ("values", dv_local),
                     ("values", do)], dht,
                    state_outputs(B, H, Tp // C, Dk, Dv, cd, Shape((B, Tp, H, Dv), cd)), step,
                    block_k=Dk, block_v=block_v, stages=stages, reverse=True, scratch=(smem(
                        (Dk, block_v), cd), smem((C, block_v), cd), smem(
                            (C, block_v), cd)), name="kda_state_grads_mosaic", interpret=interpret)

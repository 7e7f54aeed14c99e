"""The GLA forward's state walk and outputs in one Mosaic GPU kernel (Hopper).

The split forward writes every chunk's start state to memory ([B, H, NT, Dk, Dv], as
many bytes as q and k together at Dv = 128) for the outputs kernel to read back. Here one
program per (batch row, head, block of value channels) runs two warpgroups over the
chunks:
  warpgroup 0 carries the [Dk, BV] fp32 state: it publishes the state entering chunk n
    (bf16, shared memory), then S <- keep exp(b_last) S + kg^T v;
  warpgroup 1 computes o = scale (qg S + A v) for chunk n from the published state while
    warpgroup 0 moves on to the next update;
With `with_states`, warpgroup 0 also sends each published state on to memory through TMA
(the per-chunk states the backward reads, as the split forward's state kernel writes them).
qg = q exp(b) carry_in and kg = k exp(b_last - b) in_last come in bf16 from the scores
kernel (_gla_scores.chunk_scores(decayed_with=...)), so neither warpgroup loads the fp32
decays, and A in bf16 too, a matmul operand as TMA lands it: two TMA slots each fit in
shared memory (~137 KiB at Dk = 128, BV = 64). Each warpgroup double-buffers its own TMA
loads (both read the chunk's values). Barriers: `ready` (the state for chunk n is
published) and `free` (warpgroup 1 has read it).
"""
import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.linear_attention._chunk_prep import state_factors
from pallas_kernels.linear_attention._inputs import CHUNK as C
from pallas_kernels.linear_attention._mosaic_common import (F32, ROW, kernel, load, matmul, per_row,
                                                            smem)
from pallas_kernels.linear_attention._mosaic_walk import (OutputSide, StateSide, publish,
                                                          publish_or_share, walk_and_outputs)

BLOCK_V = 64
STAGES = 2  # TMA slots per warpgroup (three would pass the 227 KiB of shared memory)
MAX_DK = 128  # the [Dk, BV] fp32 state stays in warpgroup 0's registers


def gla_forward(qg, kg, v, a, b, carry_in, h0, *, scale, interpret, with_states=False,
                block_v=BLOCK_V, stages=STAGES):
  """(o [B, Tp, H, Dv] in v's dtype, final fp32 state [B, H, Dk, Dv]) from the decayed
    rows qg, kg [B, Tp, H, Dk] and the in-chunk scores a [B, H, NT, C, C] (compute
    dtype), the in-chunk cumulative decay b (for the per-chunk state factor) and h0; with
    `with_states`, then the state entering every chunk [B, H, NT, Dk, Dv] (compute dtype)."""
  B, Tp, H, Dk = qg.shape
  Dv = v.shape[-1]
  n_chunks = Tp // C
  cd, bv = qg.dtype, block_v
  if a.dtype != cd:
    raise ValueError(f"the scores' dtype {a.dtype} is not the rows' {cd}: the kernel takes A as "
                     "a matmul operand")

  def body(kg_ref, v_ref, d_ref, qg_ref, a_ref, h0_ref, o_ref, final_ref, *refs):
    states_ref = refs[0] if with_states else None
    (kg_s, v0_s, d_s, qg_s, a_s, v1_s, s_s, o_s, bars0, bars1, ready, free,
     done) = refs[with_states:]
    vt, h, bi = lax.axis_index("v"), lax.axis_index("h"), lax.axis_index("b")
    vcols = pl.ds(vt * bv, bv)

    def fetch_state(i, slot):
      tok, bar = pl.ds(i * C, C), bars0.at[slot]
      plgpu.copy_gmem_to_smem(kg_ref.at[bi, tok, h], kg_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(v_ref.at[bi, tok, h, vcols], v0_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(d_ref.at[bi, i, h], d_s.at[slot], bar)

    def share(i, slot, S):
      publish_or_share(S, s_s, states_ref.at[bi, h, i, :, vcols] if with_states else None)

    def update(i, slot, S):
      decay = per_row(load(d_s.at[slot], ROW), (Dk, bv))
      return matmul(kg_s.at[slot].T, v0_s.at[slot], (Dk, bv), interpret, init=S * decay)

    def fetch_outputs(i, slot):
      tok, bar = pl.ds(i * C, C), bars1.at[slot]
      plgpu.copy_gmem_to_smem(qg_ref.at[bi, tok, h], qg_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(a_ref.at[bi, h, i], a_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(v_ref.at[bi, tok, h, vcols], v1_s.at[slot], bar)

    def read(i, slot):
      return matmul(qg_s.at[slot], s_s, (C, bv), interpret)

    def write(i, slot, o):
      o = matmul(a_s.at[slot], v1_s.at[slot], (C, bv), interpret, init=o)
      publish(scale * o, o_s, o_ref.at[bi, pl.ds(i * C, C), h, vcols])

    def finish(S):
      final_ref.at[bi, h, :, vcols][...] = S

    walk_and_outputs(
        n_chunks, stages, (bars0, bars1), ready, free, done,
        StateSide(fetch_state, share, update, lambda: load(h0_ref.at[bi, h, :, vcols]), finish),
        OutputSide(fetch_outputs, read, write))

  scratch = (
      smem((stages, C, Dk), cd, swizzle_row=bv),  # kg (warpgroup 0)
      smem((stages, C, bv), cd),  # v (warpgroup 0)
      plgpu.SMEM((stages, Dk), F32),  # per-chunk state factor
      smem((stages, C, Dk), cd, swizzle_row=bv),  # qg (warpgroup 1)
      smem((stages, C, C), cd, swizzle_row=bv),  # scores (warpgroup 1)
      smem((stages, C, bv), cd),  # v (warpgroup 1)
      smem((Dk, bv), cd),  # the state entering the chunk, published
      smem((C, bv), v.dtype),  # output rows on their way out
      plgpu.Barrier(num_arrivals=3, num_barriers=stages),
      plgpu.Barrier(num_arrivals=3, num_barriers=stages),
      plgpu.Barrier(num_arrivals=1),  # ready
      plgpu.Barrier(num_arrivals=1),  # free
      plgpu.Barrier(num_arrivals=2),  # done
  )
  outs = (jax.ShapeDtypeStruct((B, Tp, H, Dv), v.dtype), jax.ShapeDtypeStruct((B, H, Dk, Dv), F32))
  if with_states:
    outs += (jax.ShapeDtypeStruct((B, H, n_chunks, Dk, Dv), cd),)
  fwd = kernel(body, outs, (Dv // bv, H, B), ("v", "h", "b"), scratch, "gla_forward_mosaic",
               interpret, num_threads=2, thread_name="wg")
  return fwd(kg, v, state_factors(b, carry_in), qg, a, h0.astype(F32))

"""The KDA forward's state walk and outputs in one Mosaic GPU kernel (Hopper).

The split forward's state kernel (_kda_states_mosaic) writes every chunk's start state and
v_new for the outputs kernel (_kda_value_side.chunk_output) to read back. Here one
program per (batch row, head, block of value channels) runs two warpgroups over the
chunks, as _gla_forward_mosaic does for GLA:
  warpgroup 0 carries the [Dk, BV] fp32 state: it publishes the state entering chunk n and
    v_new = u0 - w S (compute dtype, shared memory), then S <- keep exp(b_last) S +
    kg^T v_new;
  warpgroup 1 computes o = scale (qg S + A_qk v_new) for chunk n from what was published
    while warpgroup 0 moves on to the next chunk.
With `applied` (the solve wrote T alone: _kda_intra's inverse_products="in_walk"),
warpgroup 0 takes the write keys kw and the values v in w's and u0's places, with T and
beta, and forms v_new = T (diag(beta) v - kw S) itself: the product T diag(beta) v - T kw S
of u0 - w S with the solve's products moved here, one [C, C] x [C, BV] product more a
chunk, where w and u0 no longer go through memory.
With `with_states`, warpgroup 0 also sends the state and v_new on to memory through TMA:
the backward's residuals, as the split forward's state kernel writes them. Barriers:
`ready` (chunk n's state and v_new are published) and `free` (warpgroup 1 has read them).
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.linear_attention._chunk_prep import state_factors
from pallas_kernels.linear_attention._inputs import CHUNK as C
from pallas_kernels.linear_attention._mosaic_common import (F32, ROW, kernel, load, matmul, per_row,
                                                            smem)
from pallas_kernels.linear_attention._mosaic_walk import (OutputSide, StateSide, publish,
                                                          publish_or_share, walk_and_outputs)

STAGES = 2  # TMA slots per warpgroup: ~160 KiB of shared memory at Dk = 128, BV = 64
MAX_DK = 128  # the [Dk, BV] fp32 state stays in warpgroup 0's registers


def kda_forward(w, u0, kg, qg, aqk, b, carry_in, h0, *, scale, block_v, out_dtype, interpret,
                with_states=False, stages=STAGES, applied=None):
  """(o [B, Tp, H, Dv] in out_dtype, final fp32 state [B, H, Dk, Dv]) from the in-chunk
    quantities of _kda_intra.chunk_intra (w, u0, kg, qg, A_qk in the compute dtype), the
    in-chunk cumulative decay b (for the per-chunk state factor) and h0; with
    `with_states`, then the state entering every chunk [B, H, NT, Dk, Dv] and v_new
    [B, Tp, H, Dv] (compute dtype), as _kda_states_mosaic.chunk_states gives them.
    applied: None, or (T [B, H, NT, C, C] in the compute dtype, beta [B, Tp, H]), with the
    write keys kw and the values v given as w and u0 (the module's docstring)."""
  B, Tp, H, Dk = w.shape
  Dv = u0.shape[-1]
  n_chunks = Tp // C
  cd, bv = w.dtype, block_v
  n_applied = 2 if applied is not None else 0

  def body(w_ref, u_ref, kg_ref, d_ref, qg_ref, a_ref, h0_ref, *refs):
    t_ref, beta_ref = refs[:n_applied] if applied is not None else (None, None)
    o_ref, final_ref, *refs = refs[n_applied:]
    states_ref, vn_ref = refs[:2] if with_states else (None, None)
    (w_s, u_s, kg_s, d_s, qg_s, a_s, s_s, vn_s, o_s, bars0, bars1, ready, free, done,
     *applied_s) = refs[2 * with_states:]
    t_s, beta_s = applied_s if applied is not None else (None, None)
    vt, h, bi = lax.axis_index("v"), lax.axis_index("h"), lax.axis_index("b")
    vcols = pl.ds(vt * bv, bv)

    def fetch_state(i, slot):
      tok, bar = pl.ds(i * C, C), bars0.at[slot]
      plgpu.copy_gmem_to_smem(w_ref.at[bi, tok, h], w_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(u_ref.at[bi, tok, h, vcols], u_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(kg_ref.at[bi, tok, h], kg_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(d_ref.at[bi, i, h], d_s.at[slot], bar)
      if applied is not None:
        plgpu.copy_gmem_to_smem(t_ref.at[bi, h, i], t_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(beta_ref.at[bi, h, tok], beta_s.at[slot], bar)

    def new_values(slot):
      """v_new = u0 - w S, or with `applied` T (diag(beta) v - kw S): the written values
        less the state's recall go through vn_s (warpgroup 1 is done with it) into T's
        product."""
      recalled = matmul(w_s.at[slot], s_s, (C, bv), interpret)
      if applied is None:
        return load(u_s.at[slot]).astype(F32) - recalled
      beta = per_row(load(beta_s.at[slot], ROW), (C, bv))
      vn_s[...] = (beta * load(u_s.at[slot]).astype(F32) - recalled).astype(vn_s.dtype)
      plgpu.commit_smem()
      return matmul(t_s.at[slot], vn_s, (C, bv), interpret)

    def share(i, slot, S):
      """The state entering chunk i and v_new."""
      states_dst = states_ref.at[bi, h, i, :, vcols] if with_states else None
      vn_dst = vn_ref.at[bi, pl.ds(i * C, C), h, vcols] if with_states else None
      publish_or_share(S, s_s, states_dst)
      publish_or_share(new_values(slot), vn_s, vn_dst)

    def update(i, slot, S):
      decay = per_row(load(d_s.at[slot], ROW), (Dk, bv))
      return matmul(kg_s.at[slot].T, vn_s, (Dk, bv), interpret, init=S * decay)

    def finish(S):
      final_ref.at[bi, h, :, vcols][...] = S

    def fetch_outputs(i, slot):
      tok, bar = pl.ds(i * C, C), bars1.at[slot]
      plgpu.copy_gmem_to_smem(qg_ref.at[bi, tok, h], qg_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(a_ref.at[bi, h, i], a_s.at[slot], bar)

    def read(i, slot):
      o = matmul(qg_s.at[slot], s_s, (C, bv), interpret)
      return matmul(a_s.at[slot], vn_s, (C, bv), interpret, init=o)

    def write(i, slot, o):
      publish(scale * o, o_s, o_ref.at[bi, pl.ds(i * C, C), h, vcols])

    walk_and_outputs(
        n_chunks, stages, (bars0, bars1), ready, free, done,
        StateSide(fetch_state, share, update, lambda: load(h0_ref.at[bi, h, :, vcols]), finish),
        OutputSide(fetch_outputs, read, write))

  scratch = (
      smem((stages, C, Dk), cd, swizzle_row=bv),  # w (warpgroup 0)
      smem((stages, C, bv), cd),  # u0
      smem((stages, C, Dk), cd, swizzle_row=bv),  # kg
      plgpu.SMEM((stages, Dk), F32),  # per-chunk state factor
      smem((stages, C, Dk), cd, swizzle_row=bv),  # qg (warpgroup 1)
      smem((stages, C, C), cd, swizzle_row=bv),  # A_qk
      smem((Dk, bv), cd),  # the state entering the chunk, published
      smem((C, bv), cd),  # v_new, published
      smem((C, bv), out_dtype),  # output rows on their way out
      plgpu.Barrier(num_arrivals=4 + n_applied, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      plgpu.Barrier(num_arrivals=1),  # ready
      plgpu.Barrier(num_arrivals=1),  # free
      plgpu.Barrier(num_arrivals=2),  # done
  )
  if applied is not None:
    scratch += (
        smem((stages, C, C), cd, swizzle_row=bv),  # T
        plgpu.SMEM((stages, C), F32),  # beta
    )
  outs = (jax.ShapeDtypeStruct((B, Tp, H, Dv), out_dtype), jax.ShapeDtypeStruct((B, H, Dk, Dv),
                                                                                F32))
  if with_states:
    outs += (jax.ShapeDtypeStruct((B, H, n_chunks, Dk, Dv), cd), jax.ShapeDtypeStruct(u0.shape, cd))
  fwd = kernel(body, outs, (Dv // bv, H, B), ("v", "h", "b"), scratch, "kda_forward_mosaic",
               interpret, num_threads=2, thread_name="wg")
  extra = ()
  if applied is not None:
    t_inv, beta = applied
    extra = (t_inv, jnp.swapaxes(beta.astype(F32), 1, 2))  # [B, H, Tp]: a chunk's rows in a row
  return fwd(w, u0, kg, state_factors(b, carry_in), qg, aqk, h0.astype(F32), *extra)

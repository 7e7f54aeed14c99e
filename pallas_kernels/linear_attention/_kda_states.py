"""The two sequential KDA kernels: chunk states (forward) and state gradients (backward).

One program per (batch row, head, block of value channels) carries a [Dk, BV] fp32 state
through the chunks; all in-chunk work is precomputed by the parallel kernels (_kda_intra),
so each step is two (forward) or three (backward) [64, Dk] x [Dk or 64, BV] matmuls:
  forward   v_new = u0 - w S;   S <- keep exp(b_last) S + kg^T v_new
  backward  dv_new = dv_local + kg dS;   dS <- keep exp(b_last) dS + scale qg^T do - w^T dv_new
(dS: gradient of the state after the chunk; keep: the start state survives the chunk.)
Shared memory, Dk = 256, BV = 64, bf16 operands: w / kg tiles 32 KiB + S 32 KiB + [64, BV]
8 KiB per matmul, about 100 KiB with no reuse; two pipeline stages double-buffer the next
chunk's w / kg / u0 loads (Dk = 256, BV = 32: about 140 KiB). fp32 operands at Dk = 256
(w, kg 64 KiB each) stay single-stage: about 170 KiB.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention import _kda_layout as L
from pallas_kernels.linear_attention._kda_layout import C
from pallas_kernels.linear_attention._pallas_common import F32, mm, row_as_column, rows


def _decay_through(b_ref, ci_ref, base):
  """[Dk, 1] factor that carries a state across the chunk: exp(b_last), or 0 after a reset."""
  keep = jnp.max(ci_ref[pl.ds(base + C - 1, 1)]).astype(F32)
  return keep * row_as_column(jnp.exp(rows(b_ref, base + C - 1, 1)))


def _states_kernel(w_ref, u0_ref, kg_ref, b_ref, ci_ref, h0_ref, h_ref, vn_ref, ht_ref, *, n_chunks,
                   cd):

  def chunk(c, S):
    base = c * C
    h_ref[c] = S.astype(h_ref.dtype)
    vn = rows(u0_ref, base, C) - mm(w_ref[pl.ds(base, C), :], S, cd)
    vn_ref[pl.ds(base, C), :] = vn.astype(vn_ref.dtype)
    return (_decay_through(b_ref, ci_ref, base) * S +
            mm(kg_ref[pl.ds(base, C), :], vn, cd, trans_a=True))

  ht_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, h0_ref[...].astype(F32))


def _dstates_kernel(qg_ref, kg_ref, w_ref, b_ref, ci_ref, dvl_ref, do_ref, dht_ref, dh_ref, dvn_ref,
                    dh0_ref, *, scale, n_chunks, cd):

  def chunk(step, dS):
    base = (n_chunks - 1 - step) * C
    dh_ref[n_chunks - 1 - step] = dS.astype(dh_ref.dtype)
    dvn = rows(dvl_ref, base, C) + mm(kg_ref[pl.ds(base, C), :], dS, cd)
    dvn_ref[pl.ds(base, C), :] = dvn.astype(dvn_ref.dtype)
    return (_decay_through(b_ref, ci_ref, base) * dS +
            scale * mm(qg_ref[pl.ds(base, C), :], do_ref[pl.ds(base, C), :], cd, trans_a=True) -
            mm(w_ref[pl.ds(base, C), :], dvn, cd, trans_a=True))

  dh0_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, dht_ref[...].astype(F32))


def _stages(Dk, cd):
  return 1 if (cd == F32 and Dk > 128) else 2


def chunk_states(w, u0, kg, b, carry_in, h0, *, block_v, cd, interpret):
  """(start state of every chunk [B,H,n,Dk,Dv] (cd), v_new [B,Tp,H,Dv] (cd), final fp32 state)."""
  B, Tp, H, Dk = w.shape
  Dv = u0.shape[-1]
  n = Tp // C
  keys, vals, state = L.seq_rows(Tp, Dk), L.seq_values(Tp, block_v), L.seq_state(Dk, block_v)
  return L.call(
      functools.partial(_states_kernel, n_chunks=n, cd=cd), (B, H, Dv // block_v),
      [keys, vals, keys, keys, L.seq_flags(Tp), state], (L.seq_states(n, Dk, block_v), vals, state),
      (L.shape(cd, B, H, n, Dk, Dv), L.shape(cd, B, Tp, H, Dv), L.shape(F32, B, H, Dk, Dv)),
      interpret=interpret, name="kda_states", num_stages=_stages(Dk, cd))(w, u0, kg, b, carry_in,
                                                                          h0)


def chunk_state_grads(qg, kg, w, b, carry_in, dv_local, do, dht, *, scale, block_v, cd, interpret):
  """(gradient of the end state of every chunk [B,H,n,Dk,Dv] (cd), total gradient of
    v_new [B,Tp,H,Dv] (cd), gradient of the initial state (fp32))."""
  B, Tp, H, Dk = w.shape
  Dv = do.shape[-1]
  n = Tp // C
  keys, vals, state = L.seq_rows(Tp, Dk), L.seq_values(Tp, block_v), L.seq_state(Dk, block_v)
  kernel = functools.partial(_dstates_kernel, scale=scale, n_chunks=n, cd=cd)
  return L.call(kernel, (B, H, Dv // block_v),
                [keys, keys, keys, keys, L.seq_flags(Tp), vals, vals, state],
                (L.seq_states(n, Dk, block_v), vals, state),
                (L.shape(cd, B, H, n, Dk, Dv), L.shape(cd, B, Tp, H, Dv), L.shape(
                    F32, B, H, Dk, Dv)), interpret=interpret, name="kda_state_grads",
                num_stages=_stages(Dk, cd))(qg, kg, w, b, carry_in, dv_local, do, dht)

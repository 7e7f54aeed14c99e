"""The two sequential GLA kernels: chunk start states (forward) and state gradients (backward).

Each program owns one [BK, BV] tile of the fp32 state of one (batch row, head) and walks
the chunks in order (or in reverse), doing one small matmul per chunk; everything else
about a chunk is computed by the parallel kernels (`_gla_scores.py`, `_gla_chunks.py`).
The per-chunk tiles are written in the compute dtype: they only ever feed tensor-core
matmuls.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention._inputs import CHUNK as C
from pallas_kernels.linear_attention._pallas_common import (F32, compiler_params, compute_dtype,
                                                            masked_exp, mm, row_as_column, rows)


def _flag(ref, start, n=C):
  return ref[pl.ds(start, n)].astype(F32)


def _states_kernel(k_ref, v_ref, b_ref, il_ref, ci_ref, h0_ref, h_ref, ht_ref, *, n_chunks, cd):

  def chunk(c, S):
    base = c * C
    h_ref[c] = S.astype(h_ref.dtype)
    k, v, b = rows(k_ref, base, C), rows(v_ref, base, C), rows(b_ref, base, C)
    b_last = rows(b_ref, base + C - 1, 1)
    keep = jnp.max(_flag(ci_ref, base + C - 1, 1))  # the start state survives the chunk
    k_dec = k * masked_exp(b_last - b) * _flag(il_ref, base)[:, None]
    return keep * row_as_column(jnp.exp(b_last)) * S + mm(k_dec, v, cd, trans_a=True)

  ht_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, h0_ref[...].astype(F32))


def _dstates_kernel(q_ref, b_ref, ci_ref, do_ref, dht_ref, ds_ref, dh0_ref, *, scale, n_chunks, cd):

  def chunk(step, dS):
    c = n_chunks - 1 - step
    base = c * C
    ds_ref[c] = dS.astype(ds_ref.dtype)  # gradient w.r.t. the state after chunk c
    q, b, do = rows(q_ref, base, C), rows(b_ref, base, C), rows(do_ref, base, C)
    b_last = rows(b_ref, base + C - 1, 1)
    keep = jnp.max(_flag(ci_ref, base + C - 1, 1))
    q_dec = q * jnp.exp(b) * _flag(ci_ref, base)[:, None]
    return scale * mm(q_dec, do, cd, trans_a=True) + keep * row_as_column(jnp.exp(b_last)) * dS

  dh0_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, dht_ref[...].astype(F32))


def _tile_specs(Tp, bk, bv, n_chunks):
  sq = pl.squeezed
  keys = pl.BlockSpec((sq, Tp, sq, bk), lambda b, h, i, j: (b, 0, h, i))
  values = pl.BlockSpec((sq, Tp, sq, bv), lambda b, h, i, j: (b, 0, h, j))
  flags = pl.BlockSpec((sq, Tp), lambda b, h, i, j: (b, 0))
  state = pl.BlockSpec((sq, sq, bk, bv), lambda b, h, i, j: (b, h, i, j))
  per_chunk = pl.BlockSpec((sq, sq, n_chunks, bk, bv), lambda b, h, i, j: (b, h, 0, i, j))
  return keys, values, flags, state, per_chunk


def _walk_chunks(kernel, args, kinds, *, Dk, Dv, block_k, block_v, cd, interpret, num_warps,
                 num_stages, name):
  """One program per (batch row, head, state tile); `kinds` names each arg's block spec.
    Outputs: one state tile per chunk [B, H, NT, Dk, Dv] (cd) and the last carry (fp32)."""
  B, Tp, H = args[0].shape[:3]
  n_chunks = Tp // C
  keys, values, flags, state, per_chunk = _tile_specs(Tp, block_k, block_v, n_chunks)
  specs = dict(keys=keys, values=values, flags=flags, state=state)
  return pl.pallas_call(
      functools.partial(kernel, n_chunks=n_chunks, cd=cd),
      grid=(B, H, Dk // block_k, Dv // block_v),
      out_shape=(jax.ShapeDtypeStruct((B, H, n_chunks, Dk, Dv),
                                      cd), jax.ShapeDtypeStruct((B, H, Dk, Dv), F32)),
      in_specs=[specs[kind] for kind in kinds],
      out_specs=(per_chunk, state),
      compiler_params=compiler_params(num_warps, num_stages),
      interpret=interpret,
      name=name,
  )(*args)


def chunk_states(k, v, b, in_last, carry_in, h0, *, block_k, block_v, interpret, num_warps=4,
                 num_stages=2):
  """States before every chunk [B, H, NT, Dk, Dv] (compute dtype) and the final fp32 state."""
  return _walk_chunks(_states_kernel, (k, v, b, in_last, carry_in, h0),
                      ("keys", "values", "keys", "flags", "flags", "state"), Dk=k.shape[-1],
                      Dv=v.shape[-1], block_k=block_k, block_v=block_v, cd=compute_dtype(k.dtype),
                      interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                      name="gla_states")


def chunk_state_grads(q, b, carry_in, do, dht, *, scale, block_k, block_v, interpret, num_warps=4,
                      num_stages=2):
  """Gradients w.r.t. the state after every chunk [B, H, NT, Dk, Dv] and w.r.t. h0 (fp32)."""
  return _walk_chunks(functools.partial(_dstates_kernel, scale=scale), (q, b, carry_in, do, dht),
                      ("keys", "keys", "flags", "values", "state"), Dk=q.shape[-1], Dv=do.shape[-1],
                      block_k=block_k, block_v=block_v, cd=compute_dtype(q.dtype),
                      interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                      name="gla_state_grads")

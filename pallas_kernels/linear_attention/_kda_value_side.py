"""The KDA chunk kernels that work on value channels (parallel over batch, head, chunk).

Each walks the Dv channels in blocks of BV so that a dot never holds more than a
[64, Dk] + [Dk, BV] pair of compute-dtype tiles (Dk = 256, BV = 64, bf16: 64 KiB).
  output:   o = scale (qg S + A_qk v_new)
  dv_local: dv_local = scale A_qk^T do;  dP = scale do v_new^T  (causal, same run)
  wy_grads: through v_new = T diag(beta) (v - (k exp(b) ci) S):  dX = T^T dv_new,
            dv = beta dX,  dA = -dX v_new^T (strictly lower, same run; dA is the gradient of
            A_kk = diag(beta) A~),  dbeta partial = sum_v dX v
"""
import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention import _kda_layout as L
from pallas_kernels.linear_attention._kda_layout import C
from pallas_kernels.linear_attention._pallas_common import F32, iota, mm


def _cols(ref, j, bv):
  return ref[:, pl.ds(j * bv, bv)]


def _pair_mask(r_ref, strict):
  r = r_ref[...]
  t, s = iota(C, 0, (C, C)), iota(C, 1, (C, C))
  causal = s < t if strict else s <= t
  return causal & (r[:, None] == r[None, :])


def _output_kernel(qg_ref, aqk_ref, h_ref, vn_ref, o_ref, *, scale, cd, block_v):
  qg, a = qg_ref[...], aqk_ref[...]
  for j in range(o_ref.shape[-1] // block_v):
    o = mm(qg, _cols(h_ref, j, block_v), cd) + mm(a, _cols(vn_ref, j, block_v), cd)
    o_ref[:, pl.ds(j * block_v, block_v)] = (scale * o).astype(o_ref.dtype)


def _dv_local_kernel(aqk_ref, do_ref, vn_ref, r_ref, dvl_ref, dp_ref, *, scale, cd, block_v):
  a = aqk_ref[...]
  dp = jnp.zeros((C, C), F32)
  for j in range(do_ref.shape[-1] // block_v):
    do = _cols(do_ref, j, block_v)
    dvl_ref[:, pl.ds(j * block_v, block_v)] = (scale * mm(a, do, cd, trans_a=True)).astype(
        dvl_ref.dtype)
    dp += mm(do, _cols(vn_ref, j, block_v), cd, trans_b=True)
  dp_ref[...] = jnp.where(_pair_mask(r_ref, False), scale * dp, 0.0)


def _wy_grads_kernel(t_ref, dvn_ref, vn_ref, v_ref, beta_ref, r_ref, dv_ref, dx_ref, da_ref,
                     dbeta_ref, *, cd, block_v):
  t = t_ref[...]
  beta = beta_ref[...].astype(F32)[:, None]
  da = jnp.zeros((C, C), F32)
  dbeta = jnp.zeros((C, 1), F32)
  for j in range(v_ref.shape[-1] // block_v):
    cols = pl.ds(j * block_v, block_v)
    dx = mm(t, _cols(dvn_ref, j, block_v), cd, trans_a=True)
    dv_ref[:, cols] = (beta * dx).astype(dv_ref.dtype)
    dx_ref[:, cols] = dx.astype(dx_ref.dtype)
    da -= mm(dx, _cols(vn_ref, j, block_v), cd, trans_b=True)
    dbeta += jnp.sum(dx * _cols(v_ref, j, block_v).astype(F32), axis=1, keepdims=True)
  da_ref[...] = jnp.where(_pair_mask(r_ref, True), da, 0.0)
  dbeta_ref[...] = dbeta.reshape(C)


def chunk_output(qg, aqk, h, vn, *, scale, out_dtype, block_v, cd, interpret):
  B, Tp, H, Dk = qg.shape
  Dv = vn.shape[-1]
  kernel = functools.partial(_output_kernel, scale=scale, cd=cd, block_v=block_v)
  return L.call(kernel, (B, H, Tp // C),
                [L.chunk_rows(Dk),
                 L.chunk_square(),
                 L.chunk_state(Dk, Dv),
                 L.chunk_rows(Dv)], L.chunk_rows(Dv), L.shape(out_dtype, B, Tp, H, Dv),
                interpret=interpret, name="kda_output")(qg, aqk, h, vn)


def chunk_dv_local(aqk, do, vn, runs, *, scale, block_v, cd, interpret):
  """(dv_local [B,Tp,H,Dv] (cd), dP [B,H,n,C,C] fp32: the scaled gradient of A_qk)."""
  B, Tp, H, Dv = do.shape
  n = Tp // C
  kernel = functools.partial(_dv_local_kernel, scale=scale, cd=cd, block_v=block_v)
  vals = L.chunk_rows(Dv)
  return L.call(kernel, (B, H, n),
                [L.chunk_square(), vals, vals, L.chunk_flags()], (vals, L.chunk_square()),
                (L.shape(cd, B, Tp, H, Dv), L.shape(F32, B, H, n, C, C)), interpret=interpret,
                name="kda_dv_local")(aqk, do, vn, runs)


def chunk_wy_grads(t, dvn, vn, v, beta, runs, *, block_v, cd, interpret):
  """(dv [B,Tp,H,Dv] in v's dtype, dX (cd), dA [B,H,n,C,C] fp32, dbeta partial [B,Tp,H])."""
  B, Tp, H, Dv = v.shape
  n = Tp // C
  kernel = functools.partial(_wy_grads_kernel, cd=cd, block_v=block_v)
  vals = L.chunk_rows(Dv)
  return L.call(
      kernel, (B, H, n),
      [L.chunk_square(), vals, vals, vals,
       L.chunk_beta(), L.chunk_flags()], (vals, vals, L.chunk_square(), L.chunk_beta()),
      (L.shape(v.dtype, B, Tp, H, Dv), L.shape(cd, B, Tp, H, Dv), L.shape(F32, B, H, n, C, C),
       L.shape(F32, B, Tp, H)), interpret=interpret, name="kda_wy_grads")(t, dvn, vn, v, beta, runs)

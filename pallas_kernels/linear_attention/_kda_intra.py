"""In-chunk KDA kernels (parallel over batch, head, chunk): everything a 64-token chunk
needs that does not depend on the state entering it.

With b the in-chunk cumulative log decay (<= 0, non-increasing), ci / il the carry_in /
in_last flags (see _chunk_prep.segment_masks) and beta the per-token write strength:
  A_kk[t, s] = beta_t k_t . (k_s exp(b_t - b_s))   s < t, same run     T = (I + A_kk)^-1
  A_qk[t, s] = q_t . (k_s exp(b_t - b_s))          s <= t, same run
  w  = T diag(beta) (k exp(b) ci)     u0 = T diag(beta) v
  qg = q exp(b) ci                    kg = k exp(b_last - b) il
so that, with S the chunk's start state, v_new = u0 - w S, o = scale (qg S + A_qk v_new)
and the next state is keep exp(b_last) S + kg^T v_new.

Two kernels: the scores A_kk, A_qk, qg, kg and the write keys kw = diag(beta) k exp(b) ci,
one program per chunk (_kda_scores); then, one program per chunk, T by recursive doubling
(ten whole-chunk fp32-accurate products, no serial substitution) and w = T kw, u0 as
[C, C] x [C, 64] products. Live tiles are
[C, C] and [C, 64] fp32, at any D <= 256.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention import _kda_layout as L
from pallas_kernels.linear_attention._kda_layout import C
from pallas_kernels.linear_attention._kda_scores import chunk_scores
from pallas_kernels.linear_attention._pallas_common import F32, iota, mm


def exact_dot(a, b, interpret):
  """fp32 product at fp32 accuracy: the inverse amplifies rounding when keys are nearly
    parallel (see test_kda_stability). On GPU each operand split into bf16 high and low
    halves and three bf16 tensor-core products (the low halves' product dropped): faster
    than three TF32 passes (docs/kernel_tuning.md, "KDA in-chunk solve"); in interpret
    mode the plain fp32 product."""

  def dot(x, y, precision=None):
    return jax.lax.dot_general(x, y, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=F32)

  if interpret:
    return dot(a, b, jax.lax.Precision.HIGHEST)
  high = lambda x: x.astype(jnp.bfloat16)
  low = lambda x: (x - high(x).astype(F32)).astype(jnp.bfloat16)
  return dot(high(a), high(b)) + (dot(high(a), low(b)) + dot(low(a), high(b)))


def unit_lower_inverse(a, *, interpret):
  """(I + A)^-1 for a strictly lower-triangular [C, C] A by recursive doubling. With T_s
    the inverse of (I + A)'s s x s diagonal blocks (block-diagonal) and L_s the part of A
    below the diagonal s-blocks inside each 2s-block, T_2s = T_s - T_s L_s T_s: the block
    inverse [[X^-1, 0], [-Y^-1 Z X^-1, Y^-1]] of [[X, 0], [Z, Y]], for every 2s-block at once.
    T_2 = I - L_1 needs no product; then two whole-chunk products a level, log2(C) - 1
    levels, each a product of exact inverses (no power series: see test_kda_stability)."""
  n = a.shape[0]
  r, c = iota(n, 0, (n, n)), iota(n, 1, (n, n))
  below_diagonal_blocks = lambda s: (r // (2 * s) == c // (2 * s)) & (r // s > c // s)
  t = jnp.where(r == c, 1.0, 0.0) - jnp.where(below_diagonal_blocks(1), a, 0.0)
  s = 2
  while s < n:
    l_s = jnp.where(below_diagonal_blocks(s), a, 0.0)
    t = t - exact_dot(t, exact_dot(l_s, t, interpret), interpret)
    s *= 2
  return t


def _column_blocks(d):
  """Column slices of at most 64 channels: the live [C, block] tiles stay small at D = 256."""
  block = min(d, 64)
  return [pl.ds(j, block) for j in range(0, d, block)]


def _solve_kernel(akk_ref, kw_ref, v_ref, beta_ref, w_ref, u0_ref, *inverse_ref, cd, interpret):
  """One chunk: T, then w = T kw and u0 = T diag(beta) v a block of columns at a time, and
    T itself for the backward when asked (inverse_ref)."""
  t = unit_lower_inverse(akk_ref[...].astype(F32), interpret=interpret)
  beta = beta_ref[...].astype(F32)[:, None]
  for cols in _column_blocks(kw_ref.shape[1]):
    w_ref[:, cols] = mm(t, kw_ref[:, cols], cd).astype(w_ref.dtype)
  for cols in _column_blocks(v_ref.shape[1]):
    u0_ref[:, cols] = mm(t, beta * v_ref[:, cols].astype(F32), cd).astype(u0_ref.dtype)
  if inverse_ref:
    (inv_ref,) = inverse_ref
    inv_ref[...] = t.astype(inv_ref.dtype)


# Four warps spill a little at two programs an SM; eight would not, at one (untimed):
# docs/kernel_tuning.md, "KDA in-chunk solve"
SOLVE_WARPS = 4


def chunk_intra(q, k, v, b, beta, runs, carry_in, in_last, *, cd, emit_inverse, interpret,
                scores="one_kernel", solve_warps=SOLVE_WARPS, normalize=False):
  """(qg, kg, w [B,Tp,H,Dk], u0 [B,Tp,H,Dv], A_qk [B,H,n,C,C], and T [B,H,n,C,C] when
    emit_inverse), all in the compute dtype cd; with `normalize`, q and k are L2-normalised
    per token by the first scores kernel (chunk_scores), and the normalised q, k [B,Tp,H,Dk]
    (in their dtypes) follow."""
  B, Tp, H, Dk = k.shape
  Dv = v.shape[-1]
  n = Tp // C
  qg, kg, kw, a_kk, a_qk, *normed = chunk_scores(q, k, b, beta, runs, carry_in, in_last, cd=cd,
                                                 interpret=interpret, form=scores,
                                                 normalize=normalize)
  keys, values, square = L.chunk_rows(Dk), L.chunk_rows(Dv), L.chunk_square()
  out_specs, out_shape = [keys, values], [L.shape(cd, B, Tp, H, Dk), L.shape(cd, B, Tp, H, Dv)]
  if emit_inverse:
    out_specs.append(square)
    out_shape.append(L.shape(cd, B, H, n, C, C))
  solved = L.call(functools.partial(_solve_kernel, cd=cd, interpret=interpret),
                  (B, H, n), [square, keys, values, L.chunk_beta()], tuple(out_specs),
                  tuple(out_shape), interpret=interpret, name="kda_chunk_solve",
                  num_warps=solve_warps)(a_kk, kw, v, beta)
  return (qg, kg, solved[0], solved[1], a_qk, *solved[2:], *normed)

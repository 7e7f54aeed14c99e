"""The in-chunk KDA kernel as a loop over its four 16-row blocks (same contract as
_kda_intra.chunk_intra, which unrolls them).

The unrolled GLA kernels spent half of every warp's cycles waiting on the instruction
cache, and their looped forms were 1.2-1.4x faster (docs/performance.md). The in-chunk
KDA kernel unrolls more: four diagonal blocks, each with a factored and an exact branch,
and the blockwise inverse of (I + A_kk). Here one loop step handles rows s..s+15:

  A_kk, A_qk rows: the diagonal block as in _kda_intra, the blocks left of it as one
      masked [16, 64] matmul each (decays split at the previous sub-chunk's last token);
  T rows (T = (I + A_kk)^-1, lower triangular): (I + A_ii) T_i = E_i - A_i,<s T, with
      T's earlier rows carried in a [64, 64] fp32 tile (rows at or past s still zero);
  w, u0 rows: T_i diag(beta) K and T_i diag(beta) v as [16, 64] x [64, D] matmuls.

The inverse's products are exact fp32 (as in _kda_intra: rounding there is amplified
when keys are nearly parallel). Carried across steps: the [64, 64] fp32 rows of T;
within a step, [64, D] tiles (keys, decayed keys, beta-scaled K and v).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.linear_attention import _kda_layout as L
from pallas_kernels.linear_attention._kda_intra import (
    _diagonal_blocks, _inverse_16, exact_dot, flags)
from pallas_kernels.linear_attention._kda_layout import C, N_SUB
from pallas_kernels.linear_attention._pallas_common import (
    F32, SUB, iota, masked_exp, mm, rows)


def _intra_rows_kernel(q_ref, k_ref, v_ref, b_ref, beta_ref, r_ref, ci_ref, il_ref,
                       qg_ref, kg_ref, w_ref, u0_ref, aqk_ref, *inverse_ref, cd):
    b_last = rows(b_ref, C - 1, 1)
    token = iota(C, 0, (C, 1))
    cols = iota(C, 1, (SUB, C))
    row_in_block = iota(SUB, 0, (SUB, C))

    def row_block(i, t_rows):
        # the chunk's [64, D] tiles are (re)loaded per step, not kept across the loop: only
        # T's rows are carried, which keeps the registers live across steps to one tile
        s = pl.multiple_of(i * SUB, SUB)
        k_all, b_all = rows(k_ref, 0, C), rows(b_ref, 0, C)
        beta_all = beta_ref[...].astype(F32)[:, None]
        r_all = r_ref[...]
        q_i, k_i, b_i = rows(q_ref, s, SUB), rows(k_ref, s, SUB), rows(b_ref, s, SUB)
        beta_i = beta_ref[pl.ds(s, SUB)].astype(F32)[:, None]
        r_i = r_ref[pl.ds(s, SUB)]
        qg_ref[pl.ds(s, SUB), :] = (q_i * jnp.exp(b_i) * flags(ci_ref, s)).astype(qg_ref.dtype)
        kg_ref[pl.ds(s, SUB), :] = (k_i * masked_exp(b_last - b_i)
                                    * flags(il_ref, s)).astype(kg_ref.dtype)

        kk_ii, qk_ii = _diagonal_blocks(q_i, k_i, b_i, k_ref, b_ref, s)
        same_ii = r_i[:, None] == r_i[None, :]
        a_ii = jnp.where(same_ii, beta_i * kk_ii, 0.0)
        # the blocks left of the diagonal (none for the first row block: all masked)
        b_edge = rows(b_ref, jnp.maximum(s - 1, 0), 1)
        key = jnp.where(token < s, k_all * masked_exp(b_edge - b_all), 0.0)
        earlier = (cols < s) & (r_i[:, None] == r_all[None, :])
        e_i = masked_exp(b_i - b_edge)
        a_left = jnp.where(earlier, beta_i * mm(k_i * e_i, key, cd, trans_b=True), 0.0)
        qk_left = jnp.where(earlier, mm(q_i * e_i, key, cd, trans_b=True), 0.0)
        in_diag = (cols >= s) & (cols < s + SUB)
        plgpu.store(aqk_ref.at[pl.ds(s, SUB), :], qk_left.astype(aqk_ref.dtype), mask=~in_diag)
        aqk_ref[pl.ds(s, SUB), pl.ds(s, SUB)] = jnp.where(same_ii, qk_ii, 0.0).astype(aqk_ref.dtype)

        identity_rows = jnp.where(cols == s + row_in_block, 1.0, 0.0)
        t_i = exact_dot(_inverse_16(a_ii), identity_rows - exact_dot(a_left, t_rows))
        wk = beta_all * k_all * jnp.exp(b_all) * ci_ref[...].astype(F32)[:, None]
        w_ref[pl.ds(s, SUB), :] = mm(t_i, wk, cd).astype(w_ref.dtype)
        wv = beta_all * v_ref[...].astype(F32)
        u0_ref[pl.ds(s, SUB), :] = mm(t_i, wv, cd).astype(u0_ref.dtype)
        if inverse_ref:
            inverse_ref[0][pl.ds(s, SUB), :] = t_i.astype(inverse_ref[0].dtype)
        # rows s..s+15 of the [64, 64] carry: a 0/1 placement product (exact)
        placement = jnp.where(iota(C, 0, (C, SUB)) == s + iota(SUB, 1, (C, SUB)), 1.0, 0.0)
        return t_rows + exact_dot(placement, t_i)

    jax.lax.fori_loop(0, N_SUB, row_block, jnp.zeros((C, C), F32))


def chunk_intra_rows(q, k, v, b, beta, runs, carry_in, in_last, *, cd, emit_inverse,
                     interpret, num_warps=4):
    """Same outputs as _kda_intra.chunk_intra."""
    B, Tp, H, Dk = k.shape
    Dv = v.shape[-1]
    n = Tp // C
    keys, values, square = L.chunk_rows(Dk), L.chunk_rows(Dv), L.chunk_square()
    out_specs = [keys, keys, keys, values, square] + ([square] if emit_inverse else [])
    out_shape = ([L.shape(cd, B, Tp, H, Dk)] * 3 + [L.shape(cd, B, Tp, H, Dv)]
                 + [L.shape(cd, B, H, n, C, C)] * (2 if emit_inverse else 1))
    flag = L.chunk_flags()
    return L.call(functools.partial(_intra_rows_kernel, cd=cd), (B, H, n),
                  [keys, keys, values, keys, L.chunk_beta(), flag, flag, flag],
                  tuple(out_specs), tuple(out_shape), interpret=interpret,
                  name="kda_intra_rows", num_warps=num_warps)(
                      q, k, v, b, beta, runs, carry_in, in_last)

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

The scores A_kk, A_qk, qg, kg and the write keys kw = diag(beta) k exp(b) ci, one program
per chunk (_kda_scores); then, one program per chunk, T by recursive doubling
(fp32-accurate products, no serial substitution), each 32-token half on its own and the
halves joined, or over the whole chunk (_kda_solve.INVERSES), and w = T kw, u0 as
[C, C] x [C, 64] products (_kda_solve). Live tiles are [C, C] and [C, 64] fp32, at any
D <= 256. The solve runs in a kernel of its own after the scores' (solve="own_kernel", the
default), or, with the scores by layout, the HALVES chunks' scores kernel solves them in
place and the solve's kernel takes the others (solve="in_scores";
_kda_scores.chunk_scores_and_solve).
"""
import functools

from pallas_kernels.linear_attention import _kda_layout as L
from pallas_kernels.linear_attention._kda_layout import C
from pallas_kernels.linear_attention._kda_scores import chunk_scores, chunk_scores_and_solve
from pallas_kernels.linear_attention._kda_solve import INVERSES, inverse_kernel, solve_kernel

# Four warps spill a little at two programs an SM; eight do not, at one, and took 1.5x the
# time: docs/kernel_tuning.md, "KDA in-chunk solve"
SOLVE_WARPS = 4

# Where the solve runs (chunk_intra(solve=...)): in a kernel of its own after the scores'
# kernels, or, for the HALVES chunks, in the scores' HALVES kernel (with scores="by_layout";
# otherwise as "own_kernel")
SOLVES = ("own_kernel", "in_scores")

# Where T's products w = T kw and u0 = T diag(beta) v are formed (chunk_intra(
# inverse_products=...)): by the solve's own kernel, or by the fused forward's walk, which
# reads T, kw, v and beta and forms v_new = T (diag(beta) v - kw S) per chunk; the solve
# then writes T alone (no w, u0 through memory: the walk's inputs in their place)
INVERSE_PRODUCTS = ("in_solve", "in_walk")


def chunk_intra(q, k, v, b, beta, runs, carry_in, in_last, *, cd, emit_inverse, interpret,
                scores="one_kernel", solve_warps=SOLVE_WARPS, normalize=False, solve="own_kernel",
                from_gates=False, operands="compute", inverse="by_halves", summed_rows="all",
                inverse_products="in_solve", layouts=None):
  """(qg, kg, w [B,Tp,H,Dk], u0 [B,Tp,H,Dv], A_qk [B,H,n,C,C], and T [B,H,n,C,C] when
    emit_inverse), all in the compute dtype cd; with `normalize`, of q and k L2-normalised
    per token by the first scores kernel (chunk_scores), and with emit_inverse too (what the
    backward reads) the normalised q, k [B,Tp,H,Dk] (in their dtypes) follow. solve: one of
    SOLVES (solve_warps: the own kernel's warps). b: the in-chunk cumulative log decay, or
    with from_gates the log decays, summed by the first scores kernel (chunk_scores; b
    then comes last, its rows as summed_rows says: _pallas_common.SUMMED_ROWS). operands: the
    factored score products' operand dtype (_chunk_factors.SCORE_OPERANDS); inverse: how the solve's own kernel forms T
    (_kda_solve.INVERSES). inverse_products: one of INVERSE_PRODUCTS; "in_walk" (with
    solve="own_kernel", not emit_inverse) gives the write keys kw and T [B,H,n,C,C] in w's
    and u0's places. layouts: chunk_scores' (every chunk's scores layout, or None)."""
  for name, choice, known in (("solve", solve, SOLVES), ("inverse", inverse, INVERSES),
                              ("inverse_products", inverse_products, INVERSE_PRODUCTS)):
    if choice not in known:
      raise ValueError(f"{name} = {choice!r}: expected one of {list(known)}")
  in_walk = inverse_products == "in_walk"
  if in_walk and (emit_inverse or solve != "own_kernel"):
    raise ValueError("inverse_products = 'in_walk' takes the solve's own kernel in the "
                     f"forward alone; got solve = {solve!r}, emit_inverse = {emit_inverse}")
  if solve == "in_scores" and scores == "by_layout":
    return chunk_scores_and_solve(q, k, v, b, beta, runs, carry_in, in_last, cd=cd,
                                  interpret=interpret, emit_inverse=emit_inverse,
                                  normalize=normalize, keep_normalized=emit_inverse,
                                  from_gates=from_gates, operands=operands, inverse=inverse,
                                  summed_rows=summed_rows)
  B, Tp, H, Dk = k.shape
  Dv = v.shape[-1]
  n = Tp // C
  qg, kg, kw, a_kk, a_qk, *after = chunk_scores(q, k, b, beta, runs, carry_in, in_last, cd=cd,
                                                interpret=interpret, form=scores,
                                                normalize=normalize, keep_normalized=emit_inverse,
                                                from_gates=from_gates, operands=operands,
                                                summed_rows=summed_rows, layouts=layouts)
  keys, values, square = L.chunk_rows(Dk), L.chunk_rows(Dv), L.chunk_square()
  if in_walk:
    t_inv = L.call(functools.partial(inverse_kernel, interpret=interpret, inverse=inverse),
                   (B, H, n), [square], (square,), (L.shape(cd, B, H, n, C, C),),
                   interpret=interpret, name="kda_chunk_inverse", num_warps=solve_warps)(a_kk)[0]
    return (qg, kg, kw, t_inv, a_qk, *after)
  out_specs, out_shape = [keys, values], [L.shape(cd, B, Tp, H, Dk), L.shape(cd, B, Tp, H, Dv)]
  if emit_inverse:
    out_specs.append(square)
    out_shape.append(L.shape(cd, B, H, n, C, C))
  solved = L.call(functools.partial(solve_kernel, cd=cd, interpret=interpret, inverse=inverse),
                  (B, H, n), [square, keys, values, L.chunk_beta()], tuple(out_specs),
                  tuple(out_shape), interpret=interpret, name="kda_chunk_solve",
                  num_warps=solve_warps)(a_kk, kw, v, beta)
  return (qg, kg, solved[0], solved[1], a_qk, *solved[2:], *after)

"""The KDA in-chunk solve: T = (I + A_kk)^-1 and the rows it gives, w = T kw and
u0 = T diag(beta) v (see _kda_intra for the chunk form). Called by the solve's own kernel
(solve_kernel, and solve_unless_kernel for the chunks the scores' HALVES kernel did not
solve) and at the end of that kernel, which solves its chunks in place on a [C, C] A_kk
held in registers (_kda_scores.chunk_scores_and_solve); or T alone (inverse_kernel), for the
fused forward's walk to apply itself (_kda_intra's inverse_products="in_walk").

The solve's own kernel forms T in one of the INVERSES: "whole_chunk", recursive doubling
over the whole [C, C] chunk (unit_lower_inverse), or "by_halves", each 32-token half's
inverse by doubling on its own [C/2, C/2] diagonal block, joined by the block below them
(halves_inverse): every level's products are then half as wide, about a quarter of the
tensor-core work (the whole chunk's first levels multiply blocks of zeros), and the
kernel fits three programs an SM where the whole chunk's fits two (by_halves, the default,
the faster: docs/kernel_tuning.md, "KDA in-chunk solve"). The HALVES kernel solving in
place keeps the whole chunk's doubling: [C/2, C/2] products there, below the warpgroup
matmuls' 64 rows, lowered to far more code and spills, and ran slower.
"""
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention import _chunk_factors as factors
from pallas_kernels.linear_attention._inputs import CHUNK as C
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


def unit_lower_inverse(a, *, interpret, unrolled=True):
  """(I + A)^-1 for a strictly lower-triangular [C, C] A by recursive doubling. With T_s
    the inverse of (I + A)'s s x s diagonal blocks (block-diagonal) and L_s the part of A
    below the diagonal s-blocks inside each 2s-block, T_2s = T_s - T_s L_s T_s: the block
    inverse [[X^-1, 0], [-Y^-1 Z X^-1, Y^-1]] of [[X, 0], [Z, Y]], for every 2s-block at once.
    T_2 = I - L_1 needs no product; then two whole-chunk products a level, log2(C) - 1
    levels, each a product of exact inverses (no power series: see test_kda_stability).
    Entries of A on or above the diagonal are never read (they may hold anything finite or
    not). unrolled=False: the levels as a loop, one level's code instead of five, for a
    kernel that would otherwise outgrow the SM's instruction cache (docs/kernel_tuning.md,
    "Code size"); unrolled ran faster in the solve's own kernel."""
  n = a.shape[0]
  r, c = iota(n, 0, (n, n)), iota(n, 1, (n, n))

  def below_diagonal_blocks(level):  # s = 2^level, level a Python int or (in the loop) traced
    if isinstance(level, int):
      s = 2**level
      return (r // (2 * s) == c // (2 * s)) & (r // s > c // s)
    block = lambda x, shift: jax.lax.shift_right_logical(x, shift)
    return (block(r, level + 1) == block(c, level + 1)) & (block(r, level) > block(c, level))

  def double(level, t):
    l_s = jnp.where(below_diagonal_blocks(level), a, 0.0)
    return t - exact_dot(t, exact_dot(l_s, t, interpret), interpret)

  t = jnp.where(r == c, 1.0, 0.0) - jnp.where(below_diagonal_blocks(0), a, 0.0)
  levels = range(1, n.bit_length() - 1)
  if not unrolled:
    return jax.lax.fori_loop(levels.start, levels.stop, double, t)
  for level in levels:
    t = double(level, t)
  return t


# How the solve's own kernel forms T (chunk_intra(inverse=...)): see the module's docstring
INVERSES = ("whole_chunk", "by_halves")
HALF = C // 2


def halves_inverse(a_kk, interpret):
  """(T_00, T_10, T_11), the blocks of T = (I + A)^-1 for a strictly lower-triangular
    [C, C] A given as a_kk(rows, cols) -> its block [C/2, C/2] (fp32): each half's own
    inverse (unit_lower_inverse) and the block below them, -T_11 A_10 T_00 (the block inverse
    of [[X, 0], [Z, Y]]); T_01 is zero."""
  top, bottom = pl.ds(0, HALF), pl.ds(HALF, HALF)
  t00 = unit_lower_inverse(a_kk(top, top), interpret=interpret)
  t11 = unit_lower_inverse(a_kk(bottom, bottom), interpret=interpret)
  t10 = -exact_dot(t11, exact_dot(a_kk(bottom, top), t00, interpret), interpret)
  return t00, t10, t11


def column_blocks(d):
  """Column slices of at most 64 channels: the live [C, block] tiles stay small at D = 256."""
  block = min(d, 64)
  return [pl.ds(j, block) for j in range(0, d, block)]


def write_keys(k, b, beta, carry_in_col):
  """kw = beta k exp(b) carry_in (fp32), the keys T turns into w: k, b [C, n] (any block of
    channels), beta [C, 1] and carry_in_col: () -> the carry_in flags [C, 1], loaded last
    (the order the scores' first kernel was tuned with)."""
  return beta * k * jnp.exp(b) * carry_in_col()


def store_solved(a_kk, kw_cols, v_ref, beta_col, w_ref, u0_ref, inverse_refs, *, cd, interpret,
                 unrolled=True):
  """T from a_kk [C, C] (fp32, read strictly below the diagonal; unit_lower_inverse), then
    w = T kw and u0 = T diag(beta) v a block of columns at a time (kw_cols: cols -> [C, n]
    fp32; beta_col: () -> beta [C, 1], called after T is formed), and T itself into
    inverse_refs[0] when given (for the backward)."""
  t = unit_lower_inverse(a_kk, interpret=interpret, unrolled=unrolled)
  beta = beta_col()
  for cols in column_blocks(w_ref.shape[1]):
    w_ref[:, cols] = mm(t, kw_cols(cols), cd).astype(w_ref.dtype)
  for cols in column_blocks(v_ref.shape[1]):
    u0_ref[:, cols] = mm(t, beta * v_ref[:, cols].astype(F32), cd).astype(u0_ref.dtype)
  if inverse_refs:
    (inv_ref,) = inverse_refs
    inv_ref[...] = t.astype(inv_ref.dtype)


def store_solved_by_halves(akk_ref, kw_ref, v_ref, beta_ref, w_ref, u0_ref, inverse_refs, *, cd,
                           interpret):
  """store_solved with T by halves (halves_inverse) from the chunk's refs: the top rows of w
    and u0 take T_00's product with the top rows of kw and beta v, the bottom ones T_10's
    and T_11's."""
  top, bottom = pl.ds(0, HALF), pl.ds(HALF, HALF)
  t00, t10, t11 = halves_inverse(lambda rows, cols: akk_ref[rows, cols].astype(F32), interpret)

  def store(out_ref, x):  # x(rows, cols) -> the [C/2, n] rows of the operand T multiplies
    for cols in column_blocks(out_ref.shape[1]):
      x_top = x(top, cols)
      out_ref[top, cols] = mm(t00, x_top, cd).astype(out_ref.dtype)
      out_ref[bottom,
              cols] = (mm(t10, x_top, cd) + mm(t11, x(bottom, cols), cd)).astype(out_ref.dtype)

  store(w_ref, lambda rows, cols: kw_ref[rows, cols].astype(F32))
  store(u0_ref,
        lambda rows, cols: beta_ref[rows].astype(F32)[:, None] * v_ref[rows, cols].astype(F32))
  if inverse_refs:
    store_inverse_by_halves(inverse_refs[0], t00, t10, t11)


def store_inverse_by_halves(inv_ref, t00, t10, t11):
  """T [C, C] into inv_ref from its blocks (halves_inverse), the zero block above them."""
  top, bottom = pl.ds(0, HALF), pl.ds(HALF, HALF)
  for rows, cols, block in ((top, top, t00), (bottom, top, t10), (bottom, bottom, t11),
                            (top, bottom, jnp.zeros_like(t00))):
    inv_ref[rows, cols] = block.astype(inv_ref.dtype)


def solve_kernel(akk_ref, kw_ref, v_ref, beta_ref, w_ref, u0_ref, *inverse_ref, cd, interpret,
                 inverse="by_halves"):
  """The solve's own kernel, one chunk: T from A_kk (one of INVERSES) and w, u0 from kw and v
    (store_solved), and T itself for the backward when asked (inverse_ref)."""
  if inverse == "by_halves":
    store_solved_by_halves(akk_ref, kw_ref, v_ref, beta_ref, w_ref, u0_ref, inverse_ref, cd=cd,
                           interpret=interpret)
    return
  store_solved(akk_ref[...].astype(F32), lambda cols: kw_ref[:, cols].astype(F32), v_ref,
               lambda: beta_ref[...].astype(F32)[:, None], w_ref, u0_ref, inverse_ref, cd=cd,
               interpret=interpret)


def inverse_kernel(akk_ref, inv_ref, *, interpret, inverse="by_halves"):
  """T = (I + A_kk)^-1 alone, one chunk (one of INVERSES), for a walk that applies it
    itself (_kda_forward_mosaic with `applied`): w and u0 are not formed."""
  if inverse == "by_halves":
    store_inverse_by_halves(
        inv_ref, *halves_inverse(lambda rows, cols: akk_ref[rows, cols].astype(F32), interpret))
    return
  inv_ref[...] = unit_lower_inverse(akk_ref[...].astype(F32),
                                    interpret=interpret).astype(inv_ref.dtype)


def solve_unless_kernel(flag_ref, akk_ref, kw_ref, v_ref, beta_ref, *refs, layout, cd, interpret,
                        inverse="by_halves"):
  """solve_kernel for the chunks whose layout flag is not `layout` (that layout's kernel
    solved them in place), into the outputs aliased to refs' first half."""
  outputs = refs[len(refs) // 2:]
  factors.if_layout(
      flag_ref, layout, lambda: solve_kernel(akk_ref, kw_ref, v_ref, beta_ref, *outputs, cd=cd,
                                             interpret=interpret, inverse=inverse), unless=True)

"""A 16-token sub-chunk's row block of an in-chunk score matrix (GLA's A, KDA's A_kk, A_qk).

Keys of each earlier sub-chunk enter as one [16, D] block with the decay split at this
sub-chunk's boundary (the token before `start`): queries carry exp(b_t - b_edge), keys
exp(b_edge - b_s), both exponents <= 0, so one tensor-core matmul gives each [16, 16]
block left of the diagonal. One block at a time rather than the whole chunk's keys as
one [C, D] fp32 tile, which raises register pressure and leaves fewer programs per SM
(docs/kernel_tuning.md, "Score row blocks"). The diagonal block itself comes from
_diagonal_blocks.
"""
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention._pallas_common import N_SUB, SUB, masked_exp, mm, rows


def edge_decay(b_ref, start):
  """[1, D]: the cumulative decay at the token before the sub-chunk at `start` (row 0
    for the first sub-chunk, which has no earlier keys)."""
  return rows(b_ref, jnp.maximum(start - 1, 0), 1)


def _rows_of(out_row):
  """The ref's rows that hold the sub-chunk's row block: all of a [16, C] ref, or the 16
    from out_row of a [C, C] one."""
  return slice(None) if out_row is None else pl.ds(out_row, SUB)


def store_row_blocks(products, k_ref, b_ref, r_ref, start, b_edge, out_row=None):
  """Writes the [16, C] row blocks of the sub-chunk at `start`, all but the diagonal
    block: each (ref, x, cd) of `products` gets x (its 16 rows, decayed to b_edge)
    against each earlier sub-chunk's keys decayed from b_edge, in same-segment pairs,
    and zeros right of the diagonal (in rows out_row.. of the refs; see _rows_of)."""
  r_i = r_ref[pl.ds(start, SUB)]
  out = _rows_of(out_row)

  def earlier(j, carry):
    s = pl.multiple_of(j * SUB, SUB)
    keys = rows(k_ref, s, SUB) * masked_exp(b_edge - rows(b_ref, s, SUB))
    same = r_i[:, None] == r_ref[pl.ds(s, SUB)][None, :]
    for ref, x, cd in products:
      block = jnp.where(same, mm(x, keys, cd, trans_b=True), 0.0)
      ref[out, pl.ds(s, SUB)] = block.astype(ref.dtype)
    return carry

  def later(j, carry):
    s = pl.multiple_of(j * SUB, SUB)
    for ref, _, _ in products:
      ref[out, pl.ds(s, SUB)] = jnp.zeros((SUB, SUB), ref.dtype)
    return carry

  i = start // SUB
  jax.lax.fori_loop(0, i, earlier, 0)
  jax.lax.fori_loop(i + 1, N_SUB, later, 0)


def store_diagonal(ref, block, start, out_row=None):
  ref[_rows_of(out_row), pl.ds(start, SUB)] = block.astype(ref.dtype)

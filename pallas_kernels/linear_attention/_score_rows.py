"""A 16-token sub-chunk's row block of an in-chunk score matrix (GLA's A, KDA's A_kk, A_qk).

Keys of earlier sub-chunks enter as one [C, D] block with the decay split at the
sub-chunk boundary (the token before `start`): queries carry exp(b_t - b_edge), keys
exp(b_edge - b_s), both exponents <= 0, so one tensor-core matmul gives every score left
of the diagonal block. The diagonal block itself comes from _diagonal_blocks.
"""
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.linear_attention._inputs import CHUNK as C
from pallas_kernels.linear_attention._pallas_common import SUB, iota, masked_exp, rows


def earlier_keys(k_ref, b_ref, start):
    """(the chunk's keys decayed to the boundary, zero at or past `start` [C, D]; b_edge
    [1, D], the boundary's cumulative decay). Masked rows have exponents clamped to <= 0."""
    b_edge = rows(b_ref, jnp.maximum(start - 1, 0), 1)
    keys = jnp.where((iota(C) < start)[:, None],
                     rows(k_ref, 0, C) * masked_exp(b_edge - rows(b_ref, 0, C)), 0.0)
    return keys, b_edge


def left_of_diagonal(start):
    """[16, C] mask of the columns before the sub-chunk starting at `start`."""
    return iota(C, 1, (SUB, C)) < start


def store_row_block(ref, left, diagonal, start):
    """Writes a [16, C] row block: `left` everywhere but the diagonal block (it must be
    zero past it), then the [16, 16] `diagonal` block."""
    cols = iota(C, 1, (SUB, C))
    in_diag = (cols >= start) & (cols < start + SUB)
    plgpu.store(ref, left.astype(ref.dtype), mask=~in_diag)
    ref[:, pl.ds(start, SUB)] = diagonal.astype(ref.dtype)

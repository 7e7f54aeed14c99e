"""Block specs and launch helper shared by the KDA Pallas kernels.

Arrays: tokens [B, Tp, H, D], beta [B, Tp, H], per-token int32 flags [B, Tp] (run ids,
carry_in, in_last), per-chunk [C, C] matrices [B, H, n, C, C] and per-chunk states
[B, H, n, Dk, Dv]. Parallel kernels run on a grid (b, h, chunk[, key block], launched
with that last axis fastest); the sequential kernels on (b, h, Dv block), owning a whole
sequence of one head.
"""
import jax
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention._inputs import CHUNK as C
from pallas_kernels.linear_attention._pallas_common import chunk_call, compiler_params

_sq = pl.squeezed


# grid (b, h, c): one chunk
def chunk_rows(d):
  return pl.BlockSpec((_sq, C, _sq, d), lambda b, h, c: (b, c, h, 0))


def chunk_beta():
  return pl.BlockSpec((_sq, C, _sq), lambda b, h, c: (b, c, h))


def chunk_flags():
  return pl.BlockSpec((_sq, C), lambda b, h, c: (b, c))


def chunk_square():
  return pl.BlockSpec((_sq, _sq, _sq, C, C), lambda b, h, c: (b, h, c, 0, 0))


def chunk_state(dk, dv):
  return pl.BlockSpec((_sq, _sq, _sq, dk, dv), lambda b, h, c: (b, h, c, 0, 0))


# grid (b, h, c, kb): one chunk, one block of key channels
def kblock_rows(bk):
  return pl.BlockSpec((_sq, C, _sq, bk), lambda b, h, c, kb: (b, c, h, kb))


def kblock_values(dv):
  return pl.BlockSpec((_sq, C, _sq, dv), lambda b, h, c, kb: (b, c, h, 0))


def kblock_beta():
  return pl.BlockSpec((_sq, C, _sq), lambda b, h, c, kb: (b, c, h))


def kblock_flags():
  return pl.BlockSpec((_sq, C), lambda b, h, c, kb: (b, c))


def kblock_square():
  return pl.BlockSpec((_sq, _sq, _sq, C, C), lambda b, h, c, kb: (b, h, c, 0, 0))


def kblock_state(bk, dv):
  return pl.BlockSpec((_sq, _sq, _sq, bk, dv), lambda b, h, c, kb: (b, h, c, kb, 0))


def kblock_partial_beta():
  """[B, n_kb, Tp, H]: one partial dbeta per key block, summed outside."""
  return pl.BlockSpec((_sq, _sq, C, _sq), lambda b, h, c, kb: (b, kb, c, h))


# grid (b, h, j): a whole sequence, one block of value channels
def seq_rows(tp, d):
  return pl.BlockSpec((_sq, tp, _sq, d), lambda b, h, j: (b, 0, h, 0))


def seq_values(tp, bv):
  return pl.BlockSpec((_sq, tp, _sq, bv), lambda b, h, j: (b, 0, h, j))


def seq_flags(tp):
  return pl.BlockSpec((_sq, tp), lambda b, h, j: (b, 0))


def seq_state(dk, bv):
  return pl.BlockSpec((_sq, _sq, dk, bv), lambda b, h, j: (b, h, 0, j))


def seq_states(n, dk, bv):
  return pl.BlockSpec((_sq, _sq, n, dk, bv), lambda b, h, j: (b, h, 0, 0, j))


def chunk_layout_flag():
  """[B, H, n, C] int32: a chunk's in-chunk layout, repeated over its C entries."""
  return pl.BlockSpec((_sq, _sq, _sq, C), lambda b, h, c: (b, h, c, 0))


def call(kernel, grid, in_specs, out_specs, out_shape, *, interpret, name, num_warps=4,
         num_stages=1, input_output_aliases=None):
  if len(grid) == 4:  # (b, h, chunk, j): the programs of one chunk side by side
    return chunk_call(kernel, grid, in_specs, out_specs, out_shape, num_warps=num_warps,
                      interpret=interpret, name=name, num_stages=num_stages,
                      input_output_aliases=input_output_aliases)
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, compiler_params=compiler_params(num_warps, num_stages),
                        interpret=interpret, name=name, input_output_aliases=input_output_aliases or
                        {})


def shape(dtype, *dims):
  return jax.ShapeDtypeStruct(dims, dtype)

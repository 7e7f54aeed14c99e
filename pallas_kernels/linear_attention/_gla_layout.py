"""Block specs shared by the parallel GLA kernels (_gla_scores, _gla_chunks).

Arrays: tokens [B, Tp, H, D], per-token int32 flags [B, Tp] (run ids, carry_in,
in_last), per-chunk [C, C] score matrices [B, H, n, C, C] and per-chunk states
[B, H, n, Dk, Dv]. Every parallel kernel runs on the grid (b, h, chunk, j) with j a
channel block: a kernel splits the channels it can (key or value channels; a single
block where it splits none); _pallas_common.chunk_call launches the grid with j fastest.
"""
import jax
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention._inputs import CHUNK as C
from pallas_kernels.linear_attention._pallas_common import F32

_sq = pl.squeezed


class Grid:
  """Block specs on the grid (b, h, chunk, channel block j)."""

  def chunk(self, block):
    """The chunk's tokens, channels of block j (block = all channels: the whole rows)."""
    return pl.BlockSpec((_sq, C, _sq, block), lambda b, h, c, j: (b, c, h, j))

  def all_channels(self, d):
    """The chunk's tokens, all d channels."""
    return pl.BlockSpec((_sq, C, _sq, d), lambda b, h, c, j: (b, c, h, 0))

  def flags(self):
    return pl.BlockSpec((_sq, C), lambda b, h, c, j: (b, c))

  def scores(self):
    return pl.BlockSpec((_sq, _sq, _sq, C, C), lambda b, h, c, j: (b, h, c, 0, 0))

  def layout_flag(self):
    """[B, H, n, C] int32: a chunk's in-chunk layout, repeated over its C entries."""
    return pl.BlockSpec((_sq, _sq, _sq, C), lambda b, h, c, j: (b, h, c, 0))

  def state_columns(self, dk, block):
    """A block of the chunk state's value columns (all dk key rows)."""
    return pl.BlockSpec((_sq, _sq, _sq, dk, block), lambda b, h, c, j: (b, h, c, 0, j))

  def state_rows(self, block, dv):
    """A block of the chunk state's key rows (all dv value columns)."""
    return pl.BlockSpec((_sq, _sq, _sq, block, dv), lambda b, h, c, j: (b, h, c, j, 0))


def scores_shape(B, H, Tp, dtype=F32):
  return jax.ShapeDtypeStruct((B, H, Tp // C, C, C), dtype)

"""Block specs shared by the parallel GLA kernels (_gla_scores, _gla_chunks).

Arrays: tokens [B, Tp, H, D], per-token int32 flags [B, Tp] (run ids, carry_in,
in_last), per-chunk [C, C] score matrices [B, H, n, C, C] and per-chunk states
[B, H, n, Dk, Dv]. Every parallel kernel runs on the grid (b, h, chunk, j) with
j = channel block * n_sub + sub-chunk: a kernel splits the channels it can (key or value
channels; a single block where it splits none) and, with n_sub = N_SUB, the chunk into
its independent 16-token sub-chunks, one program each (more, smaller programs keep more
warps resident than a loop over sub-chunks); _pallas_common.chunk_call launches the grid
with j fastest.
"""
import jax
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention._inputs import CHUNK as C
from pallas_kernels.linear_attention._pallas_common import F32, N_SUB, SUB
_sq = pl.squeezed


class Grid:
    """Block specs on the grid (b, h, chunk, channel block * n_sub + sub-chunk)."""

    def __init__(self, n_sub=1):
        self.n_sub = n_sub

    def _block(self, j):
        return j // self.n_sub

    def _sub(self, j):
        return j % self.n_sub

    def size(self, n_blocks):
        """The grid's last dimension for n_blocks channel blocks."""
        return n_blocks * self.n_sub

    def chunk(self, block):
        """The chunk's tokens, channels of block j (block = all channels: the whole rows)."""
        return pl.BlockSpec((_sq, C, _sq, block), lambda b, h, c, j: (b, c, h, self._block(j)))

    def all_channels(self, d):
        """The chunk's tokens, all d channels."""
        return pl.BlockSpec((_sq, C, _sq, d), lambda b, h, c, j: (b, c, h, 0))

    def sub_chunk(self, block):
        """The sub-chunk's 16 tokens, channels of block j (block = all: whole rows)."""
        return pl.BlockSpec((_sq, SUB, _sq, block),
                            lambda b, h, c, j: (b, c * N_SUB + self._sub(j), h, self._block(j)))

    def flags(self):
        return pl.BlockSpec((_sq, C), lambda b, h, c, j: (b, c))

    def scores(self):
        return pl.BlockSpec((_sq, _sq, _sq, C, C), lambda b, h, c, j: (b, h, c, 0, 0))

    def score_rows(self):
        """The sub-chunk's [16, C] row block of the chunk's scores."""
        return pl.BlockSpec((_sq, _sq, _sq, SUB, C),
                            lambda b, h, c, j: (b, h, c, self._sub(j), 0))

    def state_columns(self, dk, block):
        """A block of the chunk state's value columns (all dk key rows)."""
        return pl.BlockSpec((_sq, _sq, _sq, dk, block),
                            lambda b, h, c, j: (b, h, c, 0, self._block(j)))

    def state_rows(self, block, dv):
        """A block of the chunk state's key rows (all dv value columns)."""
        return pl.BlockSpec((_sq, _sq, _sq, block, dv),
                            lambda b, h, c, j: (b, h, c, self._block(j), 0))


def scores_shape(B, H, Tp):
    return jax.ShapeDtypeStruct((B, H, Tp // C, C, C), F32)

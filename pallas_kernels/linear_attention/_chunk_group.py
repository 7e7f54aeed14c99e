"""Several chunks in one program: a kernel whose blocks hold G consecutive chunks reads
their layout flags at once and runs a chunk's body only where its layout asks for it. A
program that finds none of its chunks ends after one load, where one program a chunk pays
a launch and a load for each (the later scores kernels find no chunk of their layout under
most gates: docs/performance.md, "The HALVES chunks whole in their own kernel, timed").

`ChunkOf` lets a chunk's body run unchanged on the group's blocks: it reads and writes
chunk g of a group as if it were the chunk's own block, folding the chunk's offset into
each index. Pallas' Triton lowering takes one indexer a load or store (no `ref.at[...]` of
a `ref.at[...]`), so the offset is added to the index the body gives, not taken as a view.
"""
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention._inputs import CHUNK as C

# how a group's block holds its chunks: along the rows (tokens, beta, per-token flags:
# chunk g is rows [g C, (g + 1) C)) or along a leading axis of G (per-chunk [C, C] matrices
# and layout flags)
ROWS, LEADING = "rows", "leading"


def _shifted(entry, offset):
  """A row index of the chunk's own block as the group's (offset: the chunk's first row)."""
  if isinstance(entry, slice):
    if entry.step not in (None, 1):
      raise ValueError(f"a strided row slice ({entry}) of a chunk in a group")
    start = 0 if entry.start is None else entry.start
    stop = C if entry.stop is None else entry.stop
    return pl.ds(offset + start, stop - start)
  if isinstance(entry, pl.Slice):
    if entry.stride != 1:
      raise ValueError(f"a strided row slice ({entry}) of a chunk in a group")
    return pl.ds(offset + entry.start, entry.size)
  return offset + entry


class ChunkOf:
  """Chunk g of a group's block `ref` (held as `kind` says), indexed, loaded and stored
    as the chunk's own block; `.at[index]` gives the group's ref at the shifted index."""

  def __init__(self, ref, g, kind):
    if kind not in (ROWS, LEADING):
      raise ValueError(f"kind = {kind!r}: expected {ROWS!r} or {LEADING!r}")
    self.ref, self.g, self.kind, self.dtype = ref, g, kind, ref.dtype
    self.shape = (C,) + tuple(ref.shape[1:]) if kind == ROWS else tuple(ref.shape[1:])

  def _index(self, index):
    index = index if isinstance(index, tuple) else (index,)
    if any(entry is Ellipsis for entry in index):
      at = next(i for i, entry in enumerate(index) if entry is Ellipsis)
      fill = len(self.shape) - (len(index) - 1)
      index = index[:at] + (slice(None),) * fill + index[at + 1:]
    index = index + (slice(None),) * (len(self.shape) - len(index))
    if self.kind == LEADING:
      return (self.g,) + index
    return (_shifted(index[0], pl.multiple_of(self.g * C, C)),) + index[1:]

  def __getitem__(self, index):
    return self.ref[self._index(index)]

  def __setitem__(self, index, value):
    self.ref[self._index(index)] = value

  @property
  def at(self):
    return _At(self)


class _At:
  """ChunkOf.at: the group's ref viewed at the chunk's index shifted (one indexer)."""

  def __init__(self, chunk):
    self.chunk = chunk

  def __getitem__(self, index):
    return self.chunk.ref.at[self.chunk._index(index)]


def each_chunk_of_layout(flag_ref, layout, body):
  """body(g) for each chunk g of a group whose layout flag is `layout`, one loop step a
    chunk; flag_ref: the group's layout flags [G, C] (a chunk's C entries alike), read at
    once before the loop."""
  size = flag_ref.shape[0]
  taken = (jnp.max(flag_ref[...], axis=1) == layout).astype(jnp.int32)

  def step(g, carry):
    which = jax.lax.broadcasted_iota(jnp.int32, (size,), 0) == g
    jax.lax.cond(jnp.max(jnp.where(which, taken, 0)) > 0, lambda: body(g), lambda: None)
    return carry

  jax.lax.fori_loop(0, size, step, 0)

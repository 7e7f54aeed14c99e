"""Top-K of score rows by threshold, one Pallas (Triton) program per row.

The algorithm of threshold_top_k.py (find the K-th largest score a few bits at a time
by counting passes over an order-preserving integer image, then take the scores above
it and the smallest-index ties), run by one program that owns a row. Under XLA each
counting pass is a reduction over the whole [rows, T] block from HBM and reads the
masked future half of causal rows too; here a program walks only its row's first
`length` scores, so a causal row of query t costs t + 1 scores per pass, and the score
kernel no longer writes the rest (docs/kernel_tuning.md, "Top-K selection").

Passes per row: 32 / bits_per_pass counting passes (2^bits - 1 thresholds each), one
counting the scores above the K-th, and one writing the selected indices in ascending
order through a running count. Same sets as jax.lax.top_k (ties: smaller index), -1
filling rows with fewer than K finite scores.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sparse_attention.kernel_setup import pad_axis, use_interpret
from pallas_kernels.sparse_attention.threshold_top_k import BITS_PER_PASS

_INT_MIN = -(2**31)  # below every score's key: entries past the row's length
_MAGNITUDE = 0x7FFFFFFF


def _signed_keys(x):
  """int32 keys whose signed order is the fp32 order (-0.0 counted as 0.0)."""
  bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
  return jnp.where(bits < 0, bits ^ _MAGNITUDE, bits)


def _row_kernel(length_ref, scores_ref, out_ref, *, k, block, bits):
  n_slots = out_ref.shape[0] - block  # k rounded up to whole blocks; then the spares
  length = length_ref[0]
  n_blocks = (length + block - 1) // block
  offsets = jax.lax.iota(jnp.int32, block)

  def load(j):
    cols = j * block + offsets
    x = scores_ref[pl.ds(j * block, block)]
    in_row = cols < length
    return x, jnp.where(in_row, _signed_keys(x), _INT_MIN), in_row, cols

  def count_at_least(thresholds):
    """Per threshold, the row's keys >= it."""

    def step(j, counts):
      _, keys, _, _ = load(j)
      hits = (keys[:, None] >= thresholds[None, :]).astype(jnp.int32)
      return counts + jnp.sum(hits, axis=0)

    return jax.lax.fori_loop(0, n_blocks, step, jnp.zeros(thresholds.shape, jnp.int32))

  # The K-th largest key, `bits` bits a pass from the top, built as an unsigned bit
  # pattern (prefix) and compared in signed form (prefix ^ INT_MIN). Digit 0 is the
  # prefix itself (always >= k keys); the digit is how many of 1 .. 2^bits - 1 still
  # leave k keys at or above.
  digits = jax.lax.iota(jnp.int32, 1 << bits)
  prefix = jnp.int32(0)
  for i in range(32 // bits):
    shift = 32 - (i + 1) * bits
    counts = count_at_least((prefix | (digits << shift)) ^ _INT_MIN)
    digit = jnp.sum(((counts >= k) & (digits > 0)).astype(jnp.int32))
    prefix = prefix | (digit << shift)
  kth = prefix ^ _INT_MIN

  def count_above(j, n):
    _, keys, _, _ = load(j)
    return n + jnp.sum((keys > kth).astype(jnp.int32))

  room = k - jax.lax.fori_loop(0, n_blocks, count_above, jnp.int32(0))

  def place(j, carry):
    taken, ties = carry
    x, keys, in_row, cols = load(j)
    tied = (keys == kth) & in_row
    tie_rank = ties + jnp.cumsum(tied.astype(jnp.int32))
    take = ((keys > kth) | (tied & (tie_rank <= room))) & in_row & (x > -jnp.inf)
    slot = taken + jnp.cumsum(take.astype(jnp.int32)) - 1
    # Entries not taken go to distinct spare slots past the k-slot region: the
    # interpreter applies a masked scatter's old values too, so they must not
    # share an address with a taken one.
    spare = n_slots + offsets
    plgpu.store(out_ref.at[jnp.where(take, slot, spare)], cols, mask=take)
    return taken + jnp.sum(take.astype(jnp.int32)), ties + jnp.sum(tied.astype(jnp.int32))

  taken, _ = jax.lax.fori_loop(0, n_blocks, place, (jnp.int32(0), jnp.int32(0)))

  def fill(j, _):  # slots past the last taken one (other addresses than `place` wrote)
    slots = j * block + offsets
    plgpu.store(out_ref.at[pl.ds(j * block, block)], jnp.full((block,), -1, jnp.int32), mask=slots
                >= taken)

  jax.lax.fori_loop(0, n_slots // block, fill, None)


def kernel_top_k(scores, k: int, lengths=None, *, bits_per_pass: int = 4, block: int = 512,
                 num_warps: int = 4):
  """Indices int32 [..., k] of the k largest fp32 scores of each row (ties: smaller
    index), as a set in ascending order; entries that would pick a -inf score are -1.

    lengths: optional int [...] per row: only the row's first `length` scores take part
    (a causal row's keys up to its query); the rest of the row is never read.
    """
  *batch, n = scores.shape
  if not 0 < k <= n:
    raise ValueError(f"k must be in [1, {n}] for rows of {n} scores, got {k}")
  if bits_per_pass not in BITS_PER_PASS:
    raise ValueError(f"bits_per_pass must be one of {BITS_PER_PASS}, got {bits_per_pass}")
  if block < 16 or block & (block - 1):
    raise ValueError(f"block must be a power of 2 >= 16, got {block}")
  rows = scores.reshape(-1, n).astype(jnp.float32)
  n_rows = rows.shape[0]
  lengths = (jnp.full((n_rows,), n, jnp.int32) if lengths is None else jnp.clip(
      jnp.asarray(lengths, jnp.int32).reshape(n_rows), 0, n))
  padded = -(-n // block) * block
  rows = pad_axis(rows, 1, padded, -jnp.inf)
  slots = -(-k // block) * block + block  # + spare slots for the entries not taken
  out = pl.pallas_call(
      functools.partial(_row_kernel, k=k, block=block, bits=bits_per_pass),
      grid=(n_rows,),
      in_specs=[pl.BlockSpec((1,), lambda r: (r,)),
                pl.BlockSpec((None, padded), lambda r: (r, 0))],
      out_specs=pl.BlockSpec((None, slots), lambda r: (r, 0)),
      out_shape=jax.ShapeDtypeStruct((n_rows, slots), jnp.int32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
      interpret=use_interpret(),
      name="sparse_attention_top_k",
  )(lengths, rows)
  return out[:, :k].reshape(*batch, k)

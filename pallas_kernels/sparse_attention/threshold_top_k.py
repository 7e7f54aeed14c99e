"""Top-K of long score rows by finding the K-th largest value, without sorting.

jax.lax.top_k with K = 2048 sorts each row (XLA's GPU top-k kernel covers small K
only), and sorting [T, T] scores grows as T^2 log T: at long T the sort dominates the
indexer (docs/kernel_tuning.md, "Top-K selection"). Selecting by threshold reads each
row a fixed number of times instead: counting passes find the K-th largest value a few
bits at a time (on an order-preserving integer image of the fp32 scores: 32 passes of
one bit, or 16 of two, or 8 of four, each of which counts 2^bits - 1 thresholds in one
read of the rows), then one pass
takes every score above it and, of the scores equal to it, those with the smallest
indices (the tie rule of lax.top_k), and places them by a running count. The result is
the same set as lax.top_k's (not its order); -1 fills rows with fewer than K finite
scores.
"""
import jax
import jax.numpy as jnp
import numpy as np

# A NumPy scalar, not a jax Array: a module-level Array would be closed over by every
# jitted caller as a device constant, which a jit lowered ahead of time and called later
# counts as one input more than it is called with.
_SIGN = np.uint32(0x80000000)


def _ordered_keys(scores):
  """uint32 keys with the order of the fp32 scores (-0.0 counted as 0.0)."""
  bits = jax.lax.bitcast_convert_type(jnp.where(scores == 0, 0.0, scores), jnp.uint32)
  return jnp.where(bits >= _SIGN, ~bits, bits | _SIGN)


def _kth_largest_key(keys, k, bits_per_pass):
  """Per row, the largest v with count(keys >= v) >= k: the k-th largest key, found
    `bits_per_pass` bits at a time from the top. The counts fall as the candidate digit
    rises, so the digit is the number of candidates 1 .. 2^bits - 1 that still count k."""
  digits = np.arange(1, 1 << bits_per_pass, dtype=np.uint32)

  def step(i, prefix):
    shift = (32 - (i + 1) * bits_per_pass).astype(jnp.uint32)
    enough = [
        jnp.sum(keys >= (prefix | jnp.left_shift(d, shift))[..., None], axis=-1) >= k
        for d in digits
    ]  # sibling reductions over the same rows: one read
    digit = sum(e.astype(jnp.uint32) for e in enough)
    return prefix | jnp.left_shift(digit, shift)

  return jax.lax.fori_loop(0, 32 // bits_per_pass, step, jnp.zeros(keys.shape[:-1], jnp.uint32))


BITS_PER_PASS = (1, 2, 4)


def threshold_top_k(scores, k: int, bits_per_pass: int = 2):
  """Indices int32 [..., k] of the k largest fp32 scores of each row (ties: smaller
    index), as a set; entries that would pick a -inf score are -1.

    bits_per_pass: digits of the K-th score found per counting pass (default chosen by
    measurement: docs/kernel_tuning.md, "Top-K selection")."""
  *batch, n = scores.shape
  if not 0 < k <= n:
    raise ValueError(f"k must be in [1, {n}] for rows of {n} scores, got {k}")
  if bits_per_pass not in BITS_PER_PASS:
    raise ValueError(f"bits_per_pass must be one of {BITS_PER_PASS}, got {bits_per_pass}")
  rows = scores.reshape(-1, n).astype(jnp.float32)
  keys = _ordered_keys(rows)
  kth = _kth_largest_key(keys, k, bits_per_pass)[:, None]
  above, tied = keys > kth, keys == kth
  room = k - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)
  take = (above | (tied & (jnp.cumsum(tied, axis=-1, dtype=jnp.int32) <= room)))
  take = take & (rows > -jnp.inf)
  slot = jnp.where(take, jnp.cumsum(take, axis=-1, dtype=jnp.int32) - 1, k)
  row_ids = jnp.arange(rows.shape[0], dtype=jnp.int32)[:, None]
  cols = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), rows.shape)
  out = jnp.full((rows.shape[0], k + 1), -1, jnp.int32).at[row_ids, slot].set(cols)
  return out[:, :k].reshape(*batch, k)

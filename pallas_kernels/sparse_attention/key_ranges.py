"""Selections split into key ranges, so the atomic backward's working set stays in L2.

The atomic backward adds each selected key's dk/dv rows into fp32 tables of the whole
sequence. Per KV head those tables and the K/V rows gathered with them take 12 bytes
per key and channel: 48 MB at 32K keys (the H200's L2 is 50 MB), 192 MB at 128K, so at
long context most atomics and gathers go to HBM. Splitting the keys into ranges of
`keys_per_range` and running the pass once per range (all programs of one range side by
side) keeps each range's tables in L2. Each query's selection is sorted, so its keys in
a range are one slice [lo, hi) of its list.
"""

import jax
import jax.numpy as jnp

KEYS_PER_RANGE = 16384  # 24 MB of K, V, dk and dv rows per KV head (D = 128)


def n_ranges(num_keys: int, keys_per_range: int) -> int:
  return -(-num_keys // keys_per_range)


def split_by_range(indices, num_keys: int, keys_per_range: int):
  """(indices sorted ascending with the unused -1 entries last [B, T, K];
    lo, hi [B, T, R] int32: entries [lo, hi) of a row lie in key range r)."""
  unused = indices < 0
  ordered = jnp.sort(jnp.where(unused, num_keys, indices), axis=-1)  # unused: num_keys, last
  r = n_ranges(num_keys, keys_per_range)
  edges = jnp.minimum(jnp.arange(r + 1, dtype=jnp.int32) * keys_per_range, num_keys)
  # a binary search per range edge: [B, T, R + 1], never a [B, T, K, R] comparison
  # (4 GiB at 8192 queries x 2048 selected x 64 ranges of a 1M-token sequence)
  search = lambda row: jnp.searchsorted(row, edges, side="left").astype(jnp.int32)
  before = jax.vmap(search)(ordered.reshape(-1, ordered.shape[-1]))
  before = before.reshape(*ordered.shape[:-1], r + 1)
  ordered = jnp.where(ordered >= num_keys, -1, ordered).astype(jnp.int32)
  return ordered, before[..., :-1], before[..., 1:]

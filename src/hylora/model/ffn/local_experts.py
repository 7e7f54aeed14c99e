"""One expert-parallel rank's experts on the rows an all-to-all delivered to it.

The rows arrive as R blocks of C rows, block j from source rank j; within a block the
rows are sorted by local slot (the sender sorted its pairs by slot), valid rows first.
`counts[j, s]` says how many of block j's rows are for local slot s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hylora.model.ffn.experts import expert_ffn
from hylora.model.ffn.permute_rows import permute_rows


def window_counts(counts: jax.Array, first: int | jax.Array, rows: int) -> jax.Array:
  """Per (block, local slot) rows among positions [first, first + rows) of each block,
  whose pairs are sorted by local slot with `counts` [R, S] pairs per slot in all."""
  ends = jnp.cumsum(counts, axis=1)
  begins = ends - counts
  return jnp.clip(jnp.minimum(ends, first + rows) - jnp.maximum(begins, first), 0, None)


def local_experts(recv: jax.Array, counts: jax.Array, weights: dict, options: dict,
                  dropout_key) -> jax.Array:
  """Rows [R*C, d] (block j from rank j, `counts` [R, S] rows per local slot) through the
  S local experts; rows past a block's counts come out zero."""
  ranks, per_rank = counts.shape
  cap = recv.shape[0] // ranks
  ends = jnp.cumsum(counts, axis=1)  # [R, S]
  c = jnp.arange(cap, dtype=jnp.int32)
  row_slot = jnp.sum(c[None, :, None] >= ends[:, None, :], axis=-1).reshape(-1)  # S: empty
  order = jnp.argsort(row_slot, stable=True).astype(jnp.int32)
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
  y = expert_ffn(weights, permute_rows(recv, order, inverse), counts.sum(0),
                 dropout_key=dropout_key, **options)
  return permute_rows(y, inverse, order)  # rows past the groups come out zero

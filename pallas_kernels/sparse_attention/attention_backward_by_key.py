"""Pallas (Triton) key-major backward pass of top-K sparse attention: dk and dv.

A key row receives gradient from every query that selected it. The (query, key)
pairs are sorted by key once (``pairs_by_key``; the result serves every KV head),
then one program per (key, KV head) walks the queries that selected its key in
fixed-size tiles of pairs (the last tile masked) and sums its dk and dv rows in
registers, so each row is written once and no atomics are needed.

For each pair the program gathers the G query heads that read its KV head (q, do,
lse and delta = rowsum(o * do)) and recomputes p and ds with fp32 dot products: a
single key leaves no matmul tile to fill, and the pass is bound by the gathers.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sparse_attention.kernel_setup import next_power_of_2


def pairs_by_key(indices):
  """The (query, key) pairs of indices [B, T, K] (-1 = unused), grouped by key.

    Returns (queries [B, T*K] int32: the query of each pair, pairs sorted by key,
    unused entries last; starts [B, T + 1] int32: key s owns pairs
    starts[s] .. starts[s + 1] - 1).
    """
  b, t, k = indices.shape
  keys = jnp.where(indices >= 0, indices, t).astype(jnp.int32).reshape(b, t * k)
  slots = jnp.broadcast_to(jax.lax.iota(jnp.int32, t * k), (b, t * k))
  sorted_keys, sorted_slots = jax.lax.sort_key_val(keys, slots, dimension=1)
  starts = jax.vmap(
      lambda sk: jnp.searchsorted(sk, jnp.arange(t + 1, dtype=jnp.int32), side="left"))(sorted_keys)
  return sorted_slots // k, starts.astype(jnp.int32)


def _dkdv_kernel(starts_ref, queries_ref, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, dk_ref,
                 dv_ref, *, scale, groups, group_pad, rows, heads_q):
  key, head = pl.program_id(0), pl.program_id(1)
  first, end = starts_ref[key], starts_ref[key + 1]
  k_row = k_ref[...].astype(jnp.float32)  # [D]
  v_row = v_ref[...].astype(jnp.float32)
  # Row r of a tile is query head g = r % group_pad of pair r // group_pad.
  r = jax.lax.iota(jnp.int32, rows)
  pair_of_row, g = r // group_pad, r % group_pad
  pairs_per_tile = rows // group_pad

  def tile(i, carry):
    dk, dv = carry
    pair = first + i * pairs_per_tile + pair_of_row
    valid = (pair < end) & (g < groups)
    query = queries_ref[jnp.minimum(pair, end - 1)]
    row = query * heads_q + head * groups + jnp.minimum(g, groups - 1)
    q = q_ref[row, :].astype(jnp.float32)  # gather [rows, D]
    do = do_ref[row, :].astype(jnp.float32)
    s = jnp.sum(q * k_row[None, :], axis=1) * scale
    p = jnp.where(valid, jnp.exp(s - lse_ref[row]), 0.0)
    dp = jnp.sum(do * v_row[None, :], axis=1)
    ds = p * (dp - delta_ref[row])
    return dk + jnp.sum(ds[:, None] * q, axis=0), dv + jnp.sum(p[:, None] * do, axis=0)

  n_tiles = (end - first + pairs_per_tile - 1) // pairs_per_tile
  zeros = jnp.zeros(k_row.shape, jnp.float32)
  dk, dv = jax.lax.fori_loop(0, n_tiles, tile, (zeros, zeros))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def sparse_attention_dkdv(q, k, v, do, lse, delta, queries, starts, *, scale, interpret, rows=64,
                          num_warps=4, num_stages=2):
  """dk, dv [B, T, HK, D] (k's dtype) by the key-major pass.

    q, do [B, T, HQ, D]; k, v [B, T, HK, D]; lse, delta [B, T, HQ] fp32;
    queries, starts from pairs_by_key; rows: query-head rows per tile (a power of 2).
    """
  b, t, hq, d = q.shape
  hk = k.shape[2]
  groups = hq // hk
  group_pad = next_power_of_2(groups)
  rows = max(rows, group_pad)
  n_pairs = queries.shape[1]
  kernel = functools.partial(_dkdv_kernel, scale=scale, groups=groups, group_pad=group_pad,
                             rows=rows, heads_q=hq)
  one_row = pl.BlockSpec((None, None, None, d), lambda s, h, bi: (bi, s, h, 0))

  def whole_batch(*shape):
    return pl.BlockSpec((None, *shape), lambda s, h, bi: (bi,) + (0,) * len(shape))

  return pl.pallas_call(
      kernel,
      grid=(t, hk, b),  # keys vary fastest: programs in flight share one KV head
      in_specs=[
          whole_batch(t + 1),
          whole_batch(n_pairs), one_row, one_row,
          whole_batch(t * hq, d),
          whole_batch(t * hq, d),
          whole_batch(t * hq),
          whole_batch(t * hq)
      ],
      out_specs=[one_row, one_row],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="sparse_attention_dkdv_by_key",
  )(starts, queries, k, v, q.reshape(b, t * hq, d), do.reshape(b, t * hq, d),
    lse.reshape(b, t * hq), delta.reshape(b, t * hq))

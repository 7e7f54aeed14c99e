"""Sparse attention and its indexer on a sequence split over devices: gathered keys.

Each device keeps its range of the queries and gathers every key, K and V (and the
indexer's keys with the segment ids), along the sequence, over whichever mesh axes split
it (one axis, or a tuple of them: the linear device index along the tuple is the range's
index, as `shard_map` and `all_gather` both order it). The indexer is told where its
queries start (`query_offset`); the attention kernel takes indices into the gathered
keys. The gradients of the gathered keys are summed back onto their owners by a
reduce-scatter in fp32 (`gather_sequence`). The gathered K and V carry no remat name, so
under the model's memory policies (which save by name) the backward gathers them again
instead of keeping them: what is kept are each device's own rows.

Gather whole, not by index. At one 1M-token sequence over 128 devices (8192 queries
each) with 8 KV heads of 128 channels in bf16, K and V are 2 GiB each gathered whole
(the indexer's keys 256 MiB more). Fetching the selected rows from their owners instead
moves 8192 queries x 2048 selected keys = 16.8M rows of 2 KiB: 32 GiB for K alone, 16x
the whole gather, since a device's queries select most keys many times over. Even
deduplicated, the union of a late device's selections spans nearly every earlier key
(as large as the gather), its size depends on the data (static shapes must reserve all
1M rows anyway), and it costs two all-to-all rounds (the indices out, the rows back)
after the indexer instead of a gather that overlaps it. Fetching by index wins only
once the sequence exceeds T_local x top_k keys. The backward is the same trade: the
kernel's dk/dv tables cover the gathered keys (4 GiB each at 1M), reduce-scattered in
fp32; by index they would be one row per selection.

Nothing here is [T, T] or [T_local, T_global] per head: the Pallas indexer scores a
chunk of queries at a time ([chunk, T_global] fp32, at most 1 GiB), its reference
`block_q` queries at a time, the attention kernels and their reference gather only the
selected rows. The masked dense attention ("masked_dense", named only) is the exception
by design, a [T_local, T_global] mask: `by_density` never picks it at such lengths.

Balance. On a causal split, device d's queries see d + 1/2 ranges of keys on average,
so the last device's indexer scores about twice the average. With `balanced` (the
indexer's default) each device's queries are cut in two halves, half-block j of the
2P in the sequence, and device d scores half-blocks d and 2P - 1 - d, which together
see the same number of keys on every device: two `ppermute`s bring them (one of the
even half-blocks, one of the odd), each half runs the kernel with its own
`query_offset`, and two more send the indices back (at 8192 queries a device sends
its 128 MiB of bf16 indexer queries and gets 64 MiB of int32 indices back, little beside
the gathered keys). A device with an odd number of queries keeps its own order. Every
query is scored on its own against the same keys, so the indices equal the unbalanced
(and unsplit) ones. The attention itself needs no balancing: each query reads
min(top_k, its causal keys) selected keys, the same top_k everywhere except the
sequence's first top_k queries.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshes.per_shard import sequence_axes, sequence_split, split_over_batch


def balanced_half_blocks(devices: int) -> list[tuple[int, int]]:
  """The two half-blocks (of 2 * devices along the sequence) each device scores."""
  return [(d, 2 * devices - 1 - d) for d in range(devices)]


def _half_block_routes(devices: int):
  """(even, odd): for the even and the odd half-blocks, the ppermute pairs (owner,
  scorer) and, per scorer, the half-block it receives."""
  routes = {0: ([], [0] * devices), 1: ([], [0] * devices)}
  for scorer, blocks in enumerate(balanced_half_blocks(devices)):
    for block in blocks:
      pairs, received = routes[block % 2]
      pairs.append((block // 2, scorer))
      received[scorer] = block
  return routes[0], routes[1]


def indexer_key_blocks(devices: int, local_queries: int, block_k: int, balanced: bool):
  """Key blocks the Pallas indexer scores on each device (a program per query scores
  the key blocks up to its query), as a list over the devices."""

  def below(m):  # sum of q // block_k over the queries q < m
    whole, rest = divmod(m, block_k)
    return block_k * whole * (whole - 1) // 2 + rest * whole

  def blocks(first, n):  # queries first .. first + n - 1
    return n + below(first + n) - below(first)

  if not balanced:
    return [blocks(d * local_queries, local_queries) for d in range(devices)]
  half = local_queries // 2
  return [sum(blocks(j * half, half) for j in pair) for pair in balanced_half_blocks(devices)]


def in_balanced_order(call, queries: dict, seq_axes, devices: int):
  """call(queries of a range, its first position) -> per-query result [B, n, ...], run
  on half-blocks d and 2P - 1 - d of device d and returned in the device's own order."""
  half = next(iter(queries.values())).shape[1] // 2
  results = []
  for parity, (pairs, received) in enumerate(_half_block_routes(devices)):
    mine = {n: x[:, parity * half:(parity + 1) * half] for n, x in queries.items()}
    theirs = jax.lax.ppermute(mine, seq_axes, pairs)
    block = jnp.asarray(received, jnp.int32)[jax.lax.axis_index(seq_axes)]
    out = call(theirs, block * half)
    results.append(jax.lax.ppermute(out, seq_axes, [(b, a) for a, b in pairs]))
  return jnp.concatenate(results, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_floats(x, axes):
  return jax.lax.all_gather(x, axes, axis=1, tiled=True)


def _gather_floats_fwd(x, axes):
  return _gather_floats(x, axes), None


def _gather_floats_bwd(axes, _, ct):
  # every device's gradient for every key, summed in fp32 and rounded once: a bf16
  # reduce-scatter over 128 devices rounds at every step of its ring
  summed = jax.lax.psum_scatter(ct.astype(jnp.float32), axes, scatter_dimension=1, tiled=True)
  return (summed.astype(ct.dtype),)


_gather_floats.defvjp(_gather_floats_fwd, _gather_floats_bwd)


def gather_sequence(x, axes):
  """x [B, T_local, ...] of every device along the sequence axes, [B, T, ...]; a float's
  gradient summed back onto its owner in fp32."""
  if jnp.issubdtype(x.dtype, jnp.floating):
    return _gather_floats(x, axes)
  return jax.lax.all_gather(x, axes, axis=1, tiled=True)


def gathered_keys(fn, key_args: tuple[int, ...], key_kwargs: tuple[str, ...] = (),
                  offset_kwarg: str | None = None, balanced: bool = False):
  """fn(*arrays [B, T, ...], **kwargs) -> [B, T, ...] run per device on its rows and its
  range of the queries, the positional `key_args` and keyword `key_kwargs` arrays
  gathered whole along the sequence; `offset_kwarg` (if given) receives the position of
  the device's first query. With `balanced` (needs `offset_kwarg`), each device scores
  the half-blocks of queries that even out the causal work (module doc). With the
  sequence whole on each device, `split_over_batch`."""
  if balanced and offset_kwarg is None:
    raise ValueError("balanced needs offset_kwarg: each half-block is scored at its own offset")
  by_rows = split_over_batch(fn)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    split = sequence_split(args[0])
    if split is None:
      return by_rows(*args, **kwargs)
    mesh, rows, seq = split
    seq_axes = sequence_axes(seq)
    devices = math.prod(mesh.shape[a] for a in seq_axes)
    arrays = {
        **{
            i: x for i, x in enumerate(args)
        },
        **{
            k: x for k, x in kwargs.items() if isinstance(x, jax.Array)
        }
    }
    names = list(arrays)
    static = {k: x for k, x in kwargs.items() if k not in arrays}
    # in argument order, not a set's: every process must trace the same collectives
    gathered = [n for n in names if n in key_args or n in key_kwargs]
    local_queries = args[0].shape[1] // devices
    zig_zag = balanced and devices > 1 and local_queries % 2 == 0

    def call(local, offset):
      extra = {} if offset_kwarg is None else {offset_kwarg: offset}
      positional = [local[i] for i in range(len(args))]
      return fn(*positional, **{
          k: v for k, v in local.items() if isinstance(k, str)
      }, **static, **extra)

    def body(*local):
      local = dict(zip(names, local))
      for name in gathered:
        local[name] = gather_sequence(local[name], seq_axes)
      if zig_zag:
        keys = {n: local[n] for n in gathered}
        queries = {n: x for n, x in local.items() if n not in gathered}
        return in_balanced_order(lambda q, offset: call({
            **q,
            **keys
        }, offset), queries, seq_axes, devices)
      # the queries (first argument) stay local
      return call(local, jax.lax.axis_index(seq_axes) * local[0].shape[1])

    tokens = P(rows, seq)
    return jax.shard_map(body, mesh=mesh, in_specs=tuple(tokens for _ in names), out_specs=tokens,
                         check_vma=False)(*(arrays[n] for n in names))

  return wrapped


sparse_attention_over_devices = functools.partial(gathered_keys, key_args=(1, 2))
indexer_over_devices = functools.partial(gathered_keys, key_args=(1,), key_kwargs=("segment_ids",),
                                         offset_kwarg="query_offset", balanced=True)

"""Sparse attention and its indexer on a sequence split over devices: gathered keys.

Each device keeps its range of the queries and
gathers every key, K and V (and the indexer's keys with the segment ids), along the
sequence; the indexer is told where its queries start (`query_offset`), the attention
kernel takes indices into the gathered keys. The gradients of the gathered keys are
summed back onto their owners by the all-gather's transpose (a reduce-scatter).
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

from meshes.per_shard import sequence_axes, sequence_split, split_over_batch


def gathered_keys(fn, key_args: tuple[int, ...], key_kwargs: tuple[str, ...] = (),
                  offset_kwarg: str | None = None):
  """fn(*arrays [B, T, ...], **kwargs) -> [B, T, ...] run per device on its rows and its
  range of the queries, the positional `key_args` and keyword `key_kwargs` arrays
  gathered whole along the sequence; `offset_kwarg` (if given) receives the position of
  the device's first query. With the sequence whole on each device, `split_over_batch`."""
  by_rows = split_over_batch(fn)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    split = sequence_split(args[0])
    if split is None:
      return by_rows(*args, **kwargs)
    mesh, rows, seq = split
    seq_axes = sequence_axes(seq)
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
    gathered = set(key_args) | set(key_kwargs)

    def body(*local):
      local = dict(zip(names, local))
      for name in gathered & set(local):
        local[name] = jax.lax.all_gather(local[name], seq_axes, axis=1, tiled=True)
      extra = {}
      if offset_kwarg is not None:  # the queries (first argument) stay local
        extra[offset_kwarg] = jax.lax.axis_index(seq_axes) * local[0].shape[1]
      positional = [local[i] for i in range(len(args))]
      return fn(*positional, **{
          k: v for k, v in local.items() if isinstance(k, str)
      }, **static, **extra)

    tokens = P(rows, seq)
    return jax.shard_map(body, mesh=mesh, in_specs=tuple(tokens for _ in names), out_specs=tokens,
                         check_vma=False)(*(arrays[n] for n in names))

  return wrapped


sparse_attention_over_devices = functools.partial(gathered_keys, key_args=(1, 2))
indexer_over_devices = functools.partial(gathered_keys, key_args=(1,), key_kwargs=("segment_ids",),
                                         offset_kwarg="query_offset")

"""A short causal convolution on a sequence split over devices: each device takes the
previous device's last tokens as a halo.

Where the activation rules split the sequence (fewer sequences than devices), each device
holds a contiguous range of every sequence's tokens, and a convolution whose taps reach
K - 1 tokens back needs the K - 1 tokens before its range. One `ppermute` hands device i
the last HALO tokens of device i - 1 (and their segment ids); the device runs the kernel
on [halo | own range] and keeps its own range's outputs. The first device's halo is zeros
(`ppermute` fills it so), which a convolution reads as nothing; documents stay apart by
the segment ids, as the kernel keeps them apart anyway. Gradients come by autodiff: the
`ppermute` transposes to the reverse one, which adds the halo's gradient to the previous
device's last tokens.

Kernel contract: fn(x [B, T, H, D], weight [H, D, K], segment_ids [B, T] | None,
**options) -> [B, T, H, D], with K - 1 <= HALO.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshes.per_shard import sequence_axes, sequence_split, split_rows_whole_weight

# Tokens handed to the next device: the Pallas kernels' block alignment (a range of a
# multiple of 16 tokens stays one), and more than any short convolution here reaches back.
HALO = 16


def _from_previous(x, axes, n):
  """x of device i - 1 on device i (zeros on the first)."""
  return jax.lax.ppermute(x, axes, [(j, j + 1) for j in range(n - 1)])


def causal_conv_over_devices(fn):
  """fn (see the module doc) run per device on its rows and token range, with the halo of
  the range before it; with the sequence whole on each device, `split_rows_whole_weight(fn)`."""
  by_rows = split_rows_whole_weight(fn)

  @functools.wraps(fn)
  def wrapped(x, weight, segment_ids=None, **options):
    split = sequence_split(x)
    if split is None:
      return by_rows(x, weight, segment_ids, **options)
    if weight.shape[-1] - 1 > HALO:
      raise ValueError(f"{getattr(fn, '__name__', fn)}: {weight.shape[-1]} taps reach past the "
                       f"{HALO}-token halo a device receives")
    mesh, rows, seq = split
    seq_axes = sequence_axes(seq)
    n = math.prod(mesh.shape[a] for a in seq_axes)
    B, T = x.shape[:2]
    if T // n < HALO:
      raise ValueError(f"{getattr(fn, '__name__', fn)}: {T // n} tokens a device, fewer than "
                       f"the {HALO}-token halo")
    if segment_ids is None:
      segment_ids = jnp.zeros((B, T), jnp.int32)
    tokens = P(rows, seq)

    def body(x, weight, segment_ids):
      halo = _from_previous(x[:, -HALO:], seq_axes, n)
      halo_ids = _from_previous(segment_ids[:, -HALO:], seq_axes, n)
      out = fn(jnp.concatenate([halo, x], axis=1), weight,
               jnp.concatenate([halo_ids, segment_ids], axis=1), **options)
      return out[:, HALO:]

    # check_vma off: a custom call's outputs carry no varying-axes type to compare
    return jax.shard_map(body, mesh=mesh, in_specs=(tokens, P(), tokens), out_specs=tokens,
                         check_vma=False)(x, weight, segment_ids)

  return wrapped

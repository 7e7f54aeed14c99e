"""Short causal depthwise convolution over time that never reads across a packed document
boundary: each document sees zeros before its first token, as if it started the row."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.linear_attention._inputs import run_ids


def causal_depthwise_conv(x: jax.Array, weight: jax.Array,
                          segment_ids: jax.Array | None = None) -> jax.Array:
  """y[t] = sum_s weight[..., K-1-s] * x[t-s] over the taps s < K whose token lies in t's
  document; fp32 result.

  x: [B, T, *C]; weight: [*C, K] with tap K-1 on the current token (the layout of a
  PyTorch depthwise Conv1d padded by K-1 and cut to T); segment_ids: [B, T] or None (one
  document per row). K shifted multiply-adds that XLA fuses: no [T, T] array.
  """
  batch, length = x.shape[:2]
  taps = weight.shape[-1]
  channel_dims = x.ndim - 2
  xf = x.astype(jnp.float32)
  w = weight.astype(jnp.float32)
  # documents by run (a repeated id after a different one is a new document), as the
  # recurrence's kernels count them
  runs = None if segment_ids is None else run_ids(segment_ids, batch, length)
  y = xf * w[..., taps - 1]
  for s in range(1, min(taps, length)):
    past = jnp.pad(xf[:, :length - s], ((0, 0), (s, 0)) + ((0, 0),) * channel_dims)
    if runs is not None:
      same = jnp.pad(runs[:, s:] == runs[:, :-s], ((0, 0), (s, 0)))
      past = jnp.where(same.reshape(batch, length, *(1,) * channel_dims), past, 0.0)
    y = y + past * w[..., taps - 1 - s]
  return y

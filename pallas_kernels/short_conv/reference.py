"""The short causal depthwise convolution over time, in plain JAX: it never reads across a
packed document boundary (each document sees zeros before its first token, as if it
started the row); with SiLU and the per-head L2 norm, the reference of the fused kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.linear_attention._inputs import l2_normalize


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
  reach = None if segment_ids is None else token_reach(segment_ids, batch, length, taps)
  y = xf * w[..., taps - 1]
  for s in range(1, min(taps, length)):
    past = jnp.pad(xf[:, :length - s], ((0, 0), (s, 0)) + ((0, 0),) * channel_dims)  # x[t-s]
    if reach is not None:
      past = jnp.where((reach >= s).reshape(batch, length, *(1,) * channel_dims), past, 0.0)
    y = y + past * w[..., taps - 1 - s]
  return y


def token_reach(segment_ids, batch: int, length: int, taps: int) -> jax.Array:
  """[B, T] int32: how many of the K - 1 preceding tokens lie in each token's document
  (a run of equal ids; a repeated id after a different one starts a new document, as the
  recurrence's kernels count them). Tap s may read token t - s where the reach covers s.
  Local shifts only, so that on a sequence split over devices XLA exchanges a
  (K-1)-token halo (a cumulative run index would gather the whole sequence's ids onto
  every device)."""
  t = jnp.arange(length, dtype=jnp.int32)[None, :]
  if segment_ids is None:
    return jnp.broadcast_to(jnp.minimum(t, taps - 1), (batch, length))
  seg = segment_ids.astype(jnp.int32)
  joined = jnp.pad(seg[:, 1:] == seg[:, :-1], ((0, 0), (1, 0)))  # t continues t - 1's
  reach = jnp.zeros((batch, length), jnp.int32)
  same = jnp.ones((batch, length), bool)
  for s in range(1, taps):  # tap s needs the s tokens up to t all joined
    same = same & jnp.pad(joined, ((0, 0), (s - 1, 0)))[:, :length]  # joined[t - s + 1]
    reach = reach + same
  return reach


def short_conv_silu_reference(x: jax.Array, weight: jax.Array, segment_ids: jax.Array | None = None,
                              *, normalize: bool = False) -> jax.Array:
  """SiLU of the causal depthwise convolution, rounded to x's dtype; with normalize, then
  the L2 norm over the last axis (one head's channels), rounded again. x: [B, T, H, D];
  weight: [H, D, K]. The delta rule's q / k prologue (normalize) and its v's (not)."""
  y = jax.nn.silu(causal_depthwise_conv(x, weight, segment_ids)).astype(x.dtype)
  return l2_normalize(y).astype(x.dtype) if normalize else y

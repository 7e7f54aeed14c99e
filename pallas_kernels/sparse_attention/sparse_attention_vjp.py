"""Public top-K sparse attention: Pallas forward and backward tied by jax.custom_vjp.

Layout work happens here, outside the kernels: the query heads of each KV head are
grouped (and zero-padded to a matmul tile of >= 16 rows), K/V are laid out head-major
so a kernel program sees one head as a [T, D] table to gather rows from, and the index
list is padded with -1 to a whole number of key blocks.

Backward: dq comes from the query-major pass; dk and dv from relaxed fp32 atomic adds
in the same pass (dkdv="atomic", the default, faster than the key-major pass:
docs/kernel_tuning.md, "Relaxed atomics"; past `keys_per_range` keys, one pass per key
range, key_ranges.py) or from the key-major pass over the (query, key) pairs sorted by key
(dkdv="by_key", no atomics).
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import residuals
from pallas_kernels.sparse_attention import input_checks, key_ranges
from pallas_kernels.sparse_attention.attention_backward import sparse_attention_backward
from pallas_kernels.sparse_attention.attention_backward_by_key import (pairs_by_key,
                                                                       sparse_attention_dkdv)
from pallas_kernels.sparse_attention.attention_forward import sparse_attention_forward
from pallas_kernels.sparse_attention.kernel_setup import (check_head_dim, next_power_of_2, pad_axis,
                                                          tile_rows, use_interpret)

# Selected keys gathered per step, warps and pipeline stages of each kernel: small
# two-warp programs for both, more programs in flight per SM to hide the gathers' and
# atomics' latency (chosen by measurement: docs/kernel_tuning.md, "Gather kernel tiles").
_FORWARD_TILE = dict(block_k=32, num_warps=2, num_stages=3)
_BACKWARD_TILE = dict(block_k=32, num_warps=2, num_stages=3)


def group_heads(x, hk):
  """[B, T, HQ, D] -> [B, T, HK, Gp, D], query heads of one KV head together."""
  b, t, hq, d = x.shape
  g = hq // hk
  return pad_axis(x.reshape(b, t, hk, g, d), 3, tile_rows(g))


def _ungroup_heads(x, hq):
  b, t, hk = x.shape[:3]
  return x[:, :, :, :hq // hk].reshape(b, t, hq, *x.shape[4:])


def kernel_layout(q, k, v, indices, max_block_k=_FORWARD_TILE["block_k"]):
  """(q groups, k heads, v heads, padded indices, block_k) as the kernels take them."""
  hk = k.shape[2]
  block_k = min(max_block_k, max(16, next_power_of_2(indices.shape[2])))
  kp = -(-indices.shape[2] // block_k) * block_k
  return (group_heads(q, hk), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
          pad_axis(indices.astype(jnp.int32), 2, kp, -1), block_k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _sparse_attention(q, k, v, indices, scale, dkdv, keys_per_range):
  return _forward(q, k, v, indices, scale, dkdv, keys_per_range)[0]


def _forward(q, k, v, indices, scale, dkdv, keys_per_range):
  del dkdv, keys_per_range
  qg, kh, vh, idx, block_k = kernel_layout(q, k, v, indices)
  o, lse = sparse_attention_forward(qg, kh, vh, idx, scale=scale, block_k=block_k,
                                    interpret=use_interpret(), num_warps=_FORWARD_TILE["num_warps"],
                                    num_stages=_FORWARD_TILE["num_stages"])
  o = _ungroup_heads(o, q.shape[2])
  saved_o, lse = residuals.keep(o, lse)  # a remat policy saving "attention" keeps them
  return o, (q, k, v, indices, saved_o, lse)


def _backward(scale, dkdv, keys_per_range, saved, do):
  q, k, v, indices, o, lse = saved
  b, t, hq, _ = q.shape
  hk, tk = k.shape[2], k.shape[1]
  interpret = use_interpret()
  ranges = None
  if dkdv == "atomic" and key_ranges.n_ranges(tk, keys_per_range) > 1:
    indices, *ranges = key_ranges.split_by_range(indices, tk, keys_per_range)
  qg, kh, vh, idx, block_k = kernel_layout(q, k, v, indices, _BACKWARD_TILE["block_k"])
  launch = dict(num_warps=_BACKWARD_TILE["num_warps"], num_stages=_BACKWARD_TILE["num_stages"])
  do = do.astype(q.dtype)
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, T, HQ]
  dq_args = (qg, kh, vh, idx, group_heads(do, hk), lse, group_heads(delta[..., None], hk)[..., 0])
  if dkdv == "atomic":
    dq, dk, dv = sparse_attention_backward(*dq_args, scale=scale, block_k=block_k,
                                           interpret=interpret, atomic_dkdv=True, ranges=ranges,
                                           **launch)
    dq = dq.astype(q.dtype)
    dk = dk.transpose(0, 2, 1, 3).astype(k.dtype)
    dv = dv.transpose(0, 2, 1, 3).astype(v.dtype)
  else:
    dq = sparse_attention_backward(*dq_args, scale=scale, block_k=block_k, interpret=interpret,
                                   **launch)
    queries, starts = pairs_by_key(indices.astype(jnp.int32))
    lse_heads = lse[..., :hq // hk].reshape(b, t, hq)
    dk, dv = sparse_attention_dkdv(q, k, v, do, lse_heads, delta, queries, starts, scale=scale,
                                   interpret=interpret)
  return _ungroup_heads(dq, hq), dk, dv, None


_sparse_attention.defvjp(_forward, _backward)

_DKDV_METHODS = ("by_key", "atomic")


def sparse_attention(q, k, v, indices, *, scale=None, dkdv="atomic",
                     keys_per_range=key_ranges.KEYS_PER_RANGE):
  """Softmax attention of each query over its selected keys (Pallas kernels).

    Args:
      q: [B, T, HQ, D]; query head h reads KV head h // (HQ // HK).
      k, v: [B, Tk, HK, D]: Tk = T, or every key of a sequence whose queries are split
        over devices (Tk > T, "atomic" dkdv only).
      indices: int [B, T, K] selected key positions (< Tk), -1 = unused, any order.
      scale: softmax scale, default D ** -0.5.
      dkdv: how the backward sums dk/dv over the queries that selected a key:
        "atomic" (relaxed fp32 atomics in the query-major pass) or "by_key" (pairs
        sorted by key, one pass per key).
      keys_per_range: with "atomic", the backward runs one pass per range of this many
        keys (each range's K, V, dk and dv rows stay in L2).

    Returns:
      o [B, T, HQ, D] in q's dtype; a query with no valid index outputs zeros.
      Differentiable in q, k, v (custom VJP with Pallas backward kernels).
    """
  input_checks.check_attention_inputs(q, k, v, indices)
  check_head_dim("q", q.shape[3])
  if k.dtype != q.dtype or v.dtype != q.dtype:
    raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  b, t, hq, d = q.shape
  hk = k.shape[2]
  grouped_size = b * t * hk * tile_rows(hq // hk) * d
  if grouped_size > 2**31:  # the kernels address their tables with int32 offsets
    raise ValueError(f"q {q.shape} is too large for the Pallas kernels: B*T*HK*Gp*D = "
                     f"{grouped_size} elements (Gp = query heads per KV head padded "
                     f"to {tile_rows(hq // hk)}) must be at most 2**31; split the batch")
  if dkdv not in _DKDV_METHODS:
    raise ValueError(f"dkdv must be one of {_DKDV_METHODS}, got {dkdv!r}")
  if dkdv == "by_key" and k.shape[1] != t:
    raise ValueError(f"dkdv='by_key' needs one key per query (k {k.shape}, q {q.shape}); "
                     f"use 'atomic'")
  if keys_per_range < 1:
    raise ValueError(f"keys_per_range must be positive, got {keys_per_range}")
  scale = q.shape[3]**-0.5 if scale is None else float(scale)
  return _sparse_attention(q, k, v, indices, scale, dkdv, int(keys_per_range))

"""Dispatchers: how routed tokens reach their experts and come back.

A dispatcher takes the flat tokens, the router's choices and the experts, and returns
the weighted combination of expert outputs per token plus statistics. "dropless" is the
single-program reference (sort by expert once, grouped matmuls, unsort, combine); the
expert-parallel all-to-all pipeline is `expert_parallel.ep_alltoall`. `dispatchers.py`
names them for `moe.dispatch`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hylora.model.ffn.experts import expert_ffn
from hylora.model.ffn.permute_rows import gather_rows, permute_rows


def sort_by_expert(experts: jax.Array, num_experts: int):
  """experts [N, k] -> (order [N*k] permutation sorting pairs by expert, group_sizes [E]).

  The same `order` is reused by the unsort, so the backward needs no second sort."""
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  return order, group_sizes


def dropless(x: jax.Array, weights: jax.Array, experts: jax.Array, expert_weights: dict,
             options: dict, *, num_experts: int, dropout_key=None, moe=None):
  """x [N, d], weights/experts [N, k] -> (y [N, d], stats), or the same with [B, T] for
  [N]. `experts` are the slots of `expert_weights` (see placement.py); `moe` (MoEConfig)
  carries dispatcher options."""
  if x.ndim == 3:
    y, stats = dropless(x.reshape(-1, x.shape[-1]), weights.reshape(-1, weights.shape[-1]),
                        experts.reshape(-1, experts.shape[-1]), expert_weights, options,
                        num_experts=num_experts, dropout_key=dropout_key, moe=moe)
    return y.reshape(*x.shape[:2], y.shape[-1]), stats
  n, k = experts.shape
  order, group_sizes = sort_by_expert(experts, num_experts)
  token_of_pair = (order // k).astype(jnp.int32)
  inverse = jnp.argsort(order).astype(jnp.int32)  # sorted position of each pair
  # one gather in: token n is read by the sorted positions of its k pairs
  x_sorted = gather_rows(x, token_of_pair, inverse.reshape(n, k), jnp.ones((n, k), bool))
  y_sorted = expert_ffn(expert_weights, x_sorted, group_sizes, dropout_key=dropout_key, **options)
  y_pairs = permute_rows(y_sorted, inverse, order).reshape(n, k, -1)  # one gather out
  y = jnp.einsum("nkd,nk->nd", y_pairs.astype(jnp.float32), weights)
  return y.astype(x.dtype), {"dropped_tokens": jnp.zeros((), jnp.float32)}

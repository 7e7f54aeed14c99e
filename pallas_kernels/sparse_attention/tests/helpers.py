"""Shared input builders and error measures for the sparse-attention tests."""

import jax
import jax.numpy as jnp
import numpy as np


def attention_inputs(seed, b, t, hq, hk, d, dtype=jnp.bfloat16):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, hq, d), dtype)
  k = jax.random.normal(ks[1], (b, t, hk, d), dtype)
  v = jax.random.normal(ks[2], (b, t, hk, d), dtype)
  do = jax.random.normal(ks[3], (b, t, hq, d), dtype)
  return q, k, v, do


def distinct_causal_indices(seed, b, t, k):
  """K distinct keys per query drawn from all positions; future ones become -1."""
  keys = jax.random.split(jax.random.key(seed), b * t)
  perm = jax.vmap(lambda kk: jax.random.permutation(kk, t)[:k])(keys).reshape(b, t, k)
  return jnp.where(perm <= jnp.arange(t)[None, :, None], perm, -1).astype(jnp.int32)


def full_causal_indices(b, t, k):
  """Every key s <= t (K >= T), in reversed order to show that order is irrelevant."""
  pos = jnp.arange(t)
  idx = jnp.where(pos[None, :] <= pos[:, None], pos[None, :], -1)[:, ::-1]
  idx = jnp.pad(idx, ((0, 0), (0, k - t)), constant_values=-1)
  return jnp.broadcast_to(idx[None], (b, t, k)).astype(jnp.int32)


def rel_err(a, b):
  a = jnp.asarray(a, jnp.float32).ravel()
  b = jnp.asarray(b, jnp.float32).ravel()
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def vjp(fn, q, k, v, idx, do):
  """(output, dq, dk, dv) for the cotangent do, as one compiled program."""

  @jax.jit
  def run(q, k, v, idx, do):
    out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, idx), q, k, v)
    return (out, *pullback(do))

  return run(q, k, v, idx, do)


def materialised_topk(q_idx, k_idx, w, top_k, segment_ids=None):
  """jax.lax.top_k over the full [T, T] causal score matrix (small T only)."""
  t = k_idx.shape[1]
  dots = jnp.einsum("bqhd,bsd->bqhs", q_idx.astype(jnp.float32), k_idx.astype(jnp.float32))
  scores = jnp.einsum("bqhs,bqh->bqs", jax.nn.relu(dots), w.astype(jnp.float32))
  pos = jnp.arange(t)
  ok = jnp.broadcast_to(pos[None, None, :] <= pos[None, :, None], scores.shape)
  if segment_ids is not None:
    ok = ok & (segment_ids[:, :, None] == segment_ids[:, None, :])
  _, idx = jax.lax.top_k(jnp.where(ok, scores, -jnp.inf), min(top_k, t))
  idx = jnp.where(jnp.take_along_axis(ok, idx, -1), idx, -1)
  return jnp.pad(idx, ((0, 0), (0, 0), (0, top_k - idx.shape[-1])), constant_values=-1)


def integer_indexer_inputs(seed, b, t, hi, di):
  """Small integers: fp32 scores are exact, so equal scores are true ties."""
  ks = jax.random.split(jax.random.key(seed), 4)
  q_idx = jax.random.randint(ks[0], (b, t, hi, di), -2, 3).astype(jnp.float32)
  k_idx = jax.random.randint(ks[1], (b, t, di), -2, 3).astype(jnp.float32)
  w = jax.random.randint(ks[2], (b, t, hi), -1, 3).astype(jnp.float32)
  segments = jnp.cumsum(jax.random.bernoulli(ks[3], 0.05, (b, t)), axis=1).astype(jnp.int32)
  return q_idx, k_idx, w, segments


def tied_scores():
  """[3, 5, 64] fp32 score rows for top-K selections: small integers (many exact ties),
    negative, zero and -0.0 scores, -inf (masked) entries; row [0, 0] holds 5 finite
    scores, all tied."""
  keys = jax.random.split(jax.random.key(0), 3)
  scores = jax.random.randint(keys[0], (3, 5, 64), -3, 4).astype(jnp.float32)
  scores = jnp.where(jax.random.uniform(keys[1], scores.shape) < 0.1, -0.0, scores)
  scores = jnp.where(jax.random.uniform(keys[2], scores.shape) < 0.3, -jnp.inf, scores)
  return scores.at[0, 0, :5].set(1.0).at[0, 0, 5:].set(-jnp.inf)


def lax_top_k_sets(scores, k):
  """jax.lax.top_k's selections as sorted index rows, -1 for picks of -inf scores."""
  values, idx = jax.lax.top_k(scores, k)
  return np.sort(np.where(np.asarray(values) > -np.inf, np.asarray(idx), -1), axis=-1)

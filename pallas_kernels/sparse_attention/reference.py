"""Plain-JAX reference for top-K sparse attention (DeepSeek-V3.2 style).

Three pieces, each computed query block by query block so that no [T, T] array ever
exists (memory grows with block_q * T for the indexer and block_q * K for attention):

* ``topk_indices_reference``: the lightning-indexer score
  ``I[t, s] = sum_h w[t, h] * relu(q_idx[t, h] . k_idx[s])`` and, per query, the
  ``top_k`` causal keys of the same segment with the largest score.
* ``sparse_attention_reference``: GQA softmax attention of each query over its
  selected keys only (gather, fp32 softmax, aggregate). Differentiable by autodiff.
* ``indexer_kl_loss``: the optional training signal that aligns the indexer with the
  main attention (see its docstring).

These are the ground truth that the Pallas kernels are tested against.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.sparse_attention import input_checks

_NEG_INF = float("-inf")


def _pad_axis(x, axis: int, multiple: int, value=0):
  pad = -x.shape[axis] % multiple
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _map_query_blocks(fn, block_q: int, *per_query_arrays):
  """Applies fn to [B, block_q, ...] slices of [B, T, ...] arrays; concatenates on T."""
  t = per_query_arrays[0].shape[1]
  padded = [_pad_axis(a, 1, block_q) for a in per_query_arrays]
  n_blocks = padded[0].shape[1] // block_q
  blocked = [a.reshape(a.shape[0], n_blocks, block_q, *a.shape[2:]).swapaxes(0, 1) for a in padded]
  starts = jnp.arange(n_blocks, dtype=jnp.int32) * block_q
  out = jax.lax.map(lambda xs: fn(xs[0], *xs[1:]), (starts, *blocked))
  out = out.swapaxes(0, 1)
  return out.reshape(out.shape[0], -1, *out.shape[3:])[:, :t]


def indexer_scores_block(q_idx_block, k_idx, w_block, *, block_k: int = 1024):
  """Indexer scores of one query block against all keys, fp32 [B, bq, T].

    Keys are visited in blocks of block_k so that the per-head [bq, HI, block_k]
    intermediate stays small even for a million keys.
    """
  t = k_idx.shape[1]
  block_k = min(block_k, t)
  keys = _pad_axis(k_idx, 1, block_k)
  n_kb = keys.shape[1] // block_k
  keys = keys.reshape(keys.shape[0], n_kb, block_k, keys.shape[2]).swapaxes(0, 1)
  w32 = w_block.astype(jnp.float32)

  def one_key_block(kb):  # kb [B, block_k, DI]
    dots = jnp.einsum("bqhd,bsd->bqhs", q_idx_block, kb, preferred_element_type=jnp.float32)
    return jnp.einsum("bqhs,bqh->bqs", jax.nn.relu(dots), w32)

  scores = jax.lax.map(one_key_block, keys)  # [n_kb, B, bq, block_k]
  return scores.transpose(1, 2, 0, 3).reshape(scores.shape[1], scores.shape[2], -1)[..., :t]


def selectable_mask(q_start, block_q: int, t: int, segment_ids=None, batch: int = 1):
  """[B, block_q, T] bool: key s of T keys is selectable by the query at position
  q_start + i (causal, same segment)."""
  rows = q_start + jnp.arange(block_q, dtype=jnp.int32)
  cols = jnp.arange(t, dtype=jnp.int32)
  mask = (cols[None, :] <= rows[:, None]) & (rows[:, None] < t)
  mask = jnp.broadcast_to(mask[None], (batch, block_q, t))
  if segment_ids is not None:
    # padded by a whole block: a block starting at any key position is never clamped back
    padded = jnp.pad(segment_ids, ((0, 0), (0, block_q)), constant_values=-1)
    seg_rows = jax.lax.dynamic_slice_in_dim(padded, q_start, block_q, axis=1)
    mask = mask & (seg_rows[:, :, None] == segment_ids[:, None, :])
  return mask


def topk_indices_reference(q_idx, k_idx, w, *, top_k: int, segment_ids=None, query_offset=None,
                           block_q: int = 64):
  """Per query, the top_k selectable keys by indexer score, int32 [B, T, top_k].

    Args:
      q_idx: [B, T, HI, DI] indexer queries.
      k_idx: [B, Tk, DI] the one shared indexer key per token (Tk = T unless
        query_offset is given).
      w: [B, T, HI] per-query, per-head weights.
      top_k: keys kept per query.
      segment_ids: optional int [B, Tk] (the keys'); a query only selects keys of its
        own segment.
      query_offset: the queries are positions query_offset .. query_offset + T - 1 of
        the keys (a device's range of a sequence split over devices; an int or a traced
        int32 scalar); indices point into the Tk keys.
      block_q: queries scored at a time (memory is O(B * block_q * Tk)).

    Returns:
      Indices of the selected keys s <= t, ordered by decreasing score (equal scores:
      smaller index first). Queries with fewer than top_k selectable keys are padded
      with -1. The selection is defined as a set; the order is a convenience.
    """
  input_checks.check_indexer_inputs(q_idx, k_idx, w, top_k, segment_ids,
                                    queries_are_a_range=query_offset is not None)
  input_checks.check_positive_int("block_q", block_q)
  b, t = q_idx.shape[:2]
  tk = k_idx.shape[1]
  offset = jnp.asarray(0 if query_offset is None else query_offset, jnp.int32)
  block_q = min(block_q, t)
  kept = min(top_k, tk)

  def one_block(q_start, q_blk, w_blk):
    scores = indexer_scores_block(q_blk, k_idx, w_blk)
    ok = selectable_mask(offset + q_start, block_q, tk, segment_ids, b)
    # lax.top_k breaks ties towards the smaller index; unselectable keys sort last.
    _, idx = jax.lax.top_k(jnp.where(ok, scores, _NEG_INF), kept)
    picked_ok = jnp.take_along_axis(ok, idx, axis=-1)
    return jnp.where(picked_ok, idx, -1).astype(jnp.int32)

  out = _map_query_blocks(one_block, block_q, q_idx, w)
  if kept < top_k:
    out = jnp.pad(out, ((0, 0), (0, 0), (0, top_k - kept)), constant_values=-1)
  return out


def _gather_rows(x, idx):
  """x [B, T, ...], idx [B, bq, K] (non-negative) -> [B, bq, K, ...]."""
  return jax.vmap(lambda xb, ib: xb[ib])(x, idx)


def _selected_probabilities(q_blk, k, idx_blk, scale):
  """Main-attention softmax over the selected keys, fp32 [B, bq, HK, G, K]."""
  b, bq, hq, d = q_blk.shape
  hk = k.shape[2]
  valid = idx_blk >= 0
  k_sel = _gather_rows(k, jnp.where(valid, idx_blk, 0))  # [B, bq, K, HK, D]
  qg = q_blk.reshape(b, bq, hk, hq // hk, d)
  s = jnp.einsum("bqhgd,bqkhd->bqhgk", qg, k_sel, preferred_element_type=jnp.float32) * scale
  mask = valid[:, :, None, None, :]
  s = jnp.where(mask, s, _NEG_INF)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)  # a query with no valid key: all p = 0
  p = jnp.where(mask, jnp.exp(s - m), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  return p / jnp.where(denom > 0, denom, 1.0), valid


def sparse_attention_reference(q, k, v, indices, *, scale=None, block_q: int = 16):
  """Softmax attention of each query over its selected keys, [B, T, HQ, D].

    Query head h reads KV head h // (HQ // HK).
    o[b, t, h] = sum_j softmax_j(scale * q[b,t,h] . k[b,j]) v[b,j] over the entries
    j of indices[b, t] that are >= 0 (-1 = unused; order is irrelevant). A query with
    no valid entry outputs zeros. Softmax in fp32; differentiable in q, k, v.
    """
  input_checks.check_attention_inputs(q, k, v, indices)
  input_checks.check_positive_int("block_q", block_q)
  b, t, hq, d = q.shape
  scale = d**-0.5 if scale is None else scale
  block_q = min(block_q, t)

  @jax.checkpoint  # the backward keeps no per-block gathers alive
  def one_block(_, q_blk, idx_blk):
    p, valid = _selected_probabilities(q_blk, k, idx_blk, scale)
    v_sel = _gather_rows(v, jnp.where(valid, idx_blk, 0))
    o = jnp.einsum("bqhgk,bqkhd->bqhgd", p, v_sel, preferred_element_type=jnp.float32)
    return o.reshape(b, -1, hq, d).astype(q.dtype)

  return _map_query_blocks(one_block, block_q, q, indices.astype(jnp.int32))


def indexer_kl_loss(q, k, q_idx, k_idx, w, indices, *, scale=None, block_q: int = 16):
  """KL training signal for the indexer (DeepSeek-V3.2 sparse stage), a scalar.

    For every query t with a non-empty selected set S_t = {indices[b, t, j] >= 0}:

      target   p_t(s) = (1 / HQ) * sum_h softmax_{s in S_t}(scale * q[t,h] . k[s])
               (the main attention distribution summed over heads, L1-normalised;
               computed with stop_gradient: the main attention is not trained by it)
      indexer  r_t(s) = softmax_{s in S_t}(I[t, s]),
               I[t, s] = sum_hi w[t,hi] * relu(q_idx[t,hi] . k_idx[s])
      KL_t     = sum_{s in S_t} p_t(s) * (log p_t(s) - log r_t(s))

    loss = mean of KL_t over the queries with a non-empty S_t (0 if there is none).
    Gradients reach q_idx, k_idx and w only. Off by default in LoRA runs.
    """
  input_checks.check_attention_inputs(q, k, k, indices)
  input_checks.check_indexer_inputs(q_idx, k_idx, w, 1, None)
  if q_idx.shape[:2] != q.shape[:2]:
    raise ValueError(f"q_idx must share [B, T] with q {q.shape}, got {q_idx.shape}")
  input_checks.check_positive_int("block_q", block_q)
  b, t, hq, d = q.shape
  scale = d**-0.5 if scale is None else scale
  block_q = min(block_q, t)
  q_sg, k_sg = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
  w32 = w.astype(jnp.float32)

  def one_block(_, q_blk, qi_blk, w_blk, idx_blk):
    p, valid = _selected_probabilities(q_blk, k_sg, idx_blk, scale)
    target = jnp.sum(p, axis=(2, 3)) / hq  # [B, bq, K]
    ki_sel = _gather_rows(k_idx, jnp.where(valid, idx_blk, 0))  # [B, bq, K, DI]
    dots = jnp.einsum("bqhd,bqkd->bqhk", qi_blk, ki_sel, preferred_element_type=jnp.float32)
    logits = jnp.einsum("bqhk,bqh->bqk", jax.nn.relu(dots), w_blk)
    logits = jnp.where(valid, logits, _NEG_INF)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    log_r = logits - m - jnp.log(
        jnp.sum(jnp.where(valid, jnp.exp(logits - m), 0.0), axis=-1, keepdims=True) + 1e-30)
    safe_t = jnp.where(target > 0, target, 1.0)
    kl_terms = jnp.where(valid & (target > 0),
                         target * (jnp.log(safe_t) - jnp.where(valid, log_r, 0.0)), 0.0)
    has_keys = jnp.any(valid, axis=-1)
    return jnp.stack([jnp.sum(kl_terms, axis=-1), has_keys.astype(jnp.float32)], -1)

  per_query = _map_query_blocks(one_block, block_q, q_sg, q_idx, w32, indices.astype(jnp.int32))
  total, count = jnp.sum(per_query[..., 0]), jnp.sum(per_query[..., 1])
  return total / jnp.maximum(count, 1.0)

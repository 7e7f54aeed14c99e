"""The plain-JAX reference against dense attention and a materialised top-K."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_attention import (indexer_kl_loss, sparse_attention_reference,
                                             topk_indices_reference)
from pallas_kernels.sparse_attention.tests import helpers


def test_reference_with_all_keys_is_dense_causal_attention():
  q, k, v, do = helpers.attention_inputs(0, 2, 37, 4, 2, 16, jnp.float32)
  idx = helpers.full_causal_indices(2, 37, 40)
  got = helpers.vjp(lambda *a: sparse_attention_reference(*a, block_q=8), q, k, v, idx, do)
  want = helpers.vjp(lambda q, k, v, _: jax.nn.dot_product_attention(q, k, v, is_causal=True), q, k,
                     v, idx, do)
  for g, w in zip(got, want):
    assert helpers.rel_err(g, w) < 1e-5


def test_reference_topk_matches_materialised_scores_with_segments():
  q_idx, k_idx, w, seg = helpers.integer_indexer_inputs(1, 2, 45, 3, 8)
  for segment_ids in (None, seg):
    got = jax.jit(
        lambda a, b, c, s: topk_indices_reference(a, b, c, top_k=12, segment_ids=s, block_q=16))(
            q_idx, k_idx, w, segment_ids)
    want = helpers.materialised_topk(q_idx, k_idx, w, 12, segment_ids)
    np.testing.assert_array_equal(got, want)  # same order too: ties to smaller index


@pytest.mark.parametrize("offset, count", [(0, 45), (16, 29), (7, 21), (40, 5)])
def test_reference_topk_of_a_query_range_equals_those_rows_of_the_whole(offset, count):
  q_idx, k_idx, w, seg = helpers.integer_indexer_inputs(3, 2, 45, 3, 8)
  whole = topk_indices_reference(q_idx, k_idx, w, top_k=12, segment_ids=seg, block_q=16)
  part = jax.jit(lambda a, c, o: topk_indices_reference(
      a, k_idx, c, top_k=12, segment_ids=seg, query_offset=o, block_q=16))(
          q_idx[:, offset:offset + count], w[:, offset:offset + count], offset)
  np.testing.assert_array_equal(part, whole[:, offset:offset + count])


def test_query_without_keys_outputs_zeros():
  q, k, v, _ = helpers.attention_inputs(2, 1, 8, 2, 1, 16, jnp.float32)
  idx = jnp.full((1, 8, 4), -1, jnp.int32).at[:, 4:, 0].set(0)
  o = jax.jit(sparse_attention_reference)(q, k, v, idx)
  assert float(jnp.abs(o[:, :4]).max()) == 0.0
  np.testing.assert_allclose(o[:, 4:], jnp.broadcast_to(v[:, :1], (1, 4, 2, 16)), rtol=1e-6)


def test_indexer_kl_loss_matches_its_definition_and_trains_only_the_indexer():
  b, t, hq, hk, d, hi, di, top_k = 1, 12, 4, 2, 16, 3, 8, 5
  q, k, _, _ = helpers.attention_inputs(3, b, t, hq, hk, d, jnp.float32)
  ks = jax.random.split(jax.random.key(4), 3)
  q_idx = jax.random.normal(ks[0], (b, t, hi, di))
  k_idx = jax.random.normal(ks[1], (b, t, di))
  w = jax.random.normal(ks[2], (b, t, hi))
  idx = jax.jit(lambda *a: topk_indices_reference(*a, top_k=top_k))(q_idx, k_idx, w)
  loss_fn = jax.jit(lambda q, w: indexer_kl_loss(q, k, q_idx, k_idx, w, idx, block_q=4))

  # Direct dense evaluation of the docstring's formula, in numpy.
  qn, kn, qin, kin, wn, idn = map(np.asarray, (q, k, q_idx, k_idx, w, idx))
  total = 0.0
  for tq in range(t):
    sel = idn[0, tq][idn[0, tq] >= 0]
    kk = np.repeat(kn[0, sel], hq // hk, axis=1)  # [n, HQ, D]
    logit_att = np.einsum("hd,nhd->hn", qn[0, tq], kk) * d**-0.5
    att = np.exp(logit_att - logit_att.max(-1, keepdims=True))
    p = (att / att.sum(-1, keepdims=True)).sum(0) / hq
    logits = wn[0, tq] @ np.maximum(qin[0, tq] @ kin[0, sel].T, 0.0)
    log_r = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    total += float(np.sum(p * (np.log(p) - log_r)))
  np.testing.assert_allclose(float(loss_fn(q, w)), total / t, rtol=1e-4)

  grads = jax.jit(jax.grad(loss_fn, (0, 1)))(q, w)
  assert float(jnp.abs(grads[0]).max()) == 0.0
  assert float(jnp.abs(grads[1]).max()) > 0.0


@pytest.mark.parametrize("bad, message", [
    (dict(q=jnp.zeros((1, 8, 4))), "q must have shape"),
    (dict(k=jnp.zeros((1, 8, 3, 16)), v=jnp.zeros((1, 8, 3, 16))), "multiple of k heads"),
    (dict(v=jnp.zeros((1, 8, 2, 8))), "v must have the shape of k"),
    (dict(indices=jnp.zeros((1, 8, 4), jnp.float32)), "indices must be an integer"),
    (dict(indices=jnp.zeros((1, 7, 4), jnp.int32)), "indices must have shape"),
])
def test_reference_attention_rejects_bad_inputs(bad, message):
  args = dict(q=jnp.zeros((1, 8, 4, 16)), k=jnp.zeros((1, 8, 2, 16)), v=jnp.zeros((1, 8, 2, 16)),
              indices=jnp.zeros((1, 8, 4), jnp.int32))
  args.update(bad)
  with pytest.raises(ValueError, match=message):
    sparse_attention_reference(**args)


@pytest.mark.parametrize("bad, message", [
    (dict(k_idx=jnp.zeros((1, 8, 4))), "k_idx must have shape"),
    (dict(w=jnp.zeros((1, 8))), "w must have shape"),
    (dict(top_k=0), "top_k must be a positive int"),
    (dict(segment_ids=jnp.zeros((1, 9), jnp.int32)), "segment_ids must have shape"),
])
def test_reference_topk_rejects_bad_inputs(bad, message):
  args = dict(q_idx=jnp.zeros((1, 8, 2, 16)), k_idx=jnp.zeros((1, 8, 16)), w=jnp.zeros((1, 8, 2)),
              top_k=4)
  args.update(bad)
  with pytest.raises(ValueError, match=message):
    topk_indices_reference(**args)

"""The Pallas kernels (interpreted on CPU) against the reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_attention import (sparse_attention, sparse_attention_reference,
                                             topk_indices)
from pallas_kernels.sparse_attention.attention_backward_by_key import pairs_by_key
from pallas_kernels.sparse_attention.key_ranges import split_by_range
from pallas_kernels.sparse_attention.tests import helpers


def test_kernel_with_all_keys_is_dense_causal_attention():
  # 3 query heads per KV head: not a power of 2, so the head padding is exercised.
  q, k, v, do = helpers.attention_inputs(10, 1, 24, 6, 2, 16, jnp.float32)
  idx = helpers.full_causal_indices(1, 24, 32)
  got = helpers.vjp(sparse_attention, q, k, v, idx, do)
  want = helpers.vjp(lambda q, k, v, _: jax.nn.dot_product_attention(q, k, v, is_causal=True), q, k,
                     v, idx, do)
  for g, w in zip(got, want):
    assert helpers.rel_err(g, w) < 1e-4


def test_pairs_by_key_lists_exactly_the_queries_that_selected_each_key():
  # Repeated keys in a row and -1 entries; two batch rows with different selections.
  idx = jax.random.randint(jax.random.key(15), (2, 30, 7), -1, 30).astype(jnp.int32)
  queries, starts = jax.jit(pairs_by_key)(idx)
  idx, queries, starts = map(np.asarray, (idx, queries, starts))
  for b in range(2):
    assert starts[b, 0] == 0 and starts[b, -1] == (idx[b] >= 0).sum()
    for key in range(30):
      want = np.nonzero(idx[b] == key)[0]  # the query of each occurrence
      got = queries[b, starts[b, key]:starts[b, key + 1]]
      np.testing.assert_array_equal(np.sort(got), want)


def test_kernel_matches_gather_reference_on_random_indices_bf16():
  q, k, v, do = helpers.attention_inputs(11, 1, 40, 4, 1, 32)
  idx = helpers.distinct_causal_indices(12, 1, 40, 20)
  idx = jnp.where(idx >= 36, -1, idx)  # the last keys: selected by no query
  assert int((idx < 0).sum()) > 0 and int((idx >= 0).sum()) > 0
  # Some keys are chosen by more queries than one tile of pairs holds (64 rows of
  # 4 heads: 16 pairs), others by none.
  counts = jnp.bincount(jnp.where(idx >= 0, idx, 40).ravel(), length=41)[:40]
  assert int(counts.max()) > 16 and int(counts.min()) == 0
  want = helpers.vjp(sparse_attention_reference, q, k, v, idx, do)
  # atomic with 8 keys per range: five backward passes, one per key range
  for method in (dict(dkdv="by_key"), dict(dkdv="atomic"), dict(dkdv="atomic", keys_per_range=8)):
    got = helpers.vjp(lambda *a: sparse_attention(*a, **method), q, k, v, idx, do)
    assert helpers.rel_err(got[0], want[0]) <= 5e-3, method
    for g, w in zip(got[1:], want[1:]):
      assert helpers.rel_err(g, w) <= 1e-2, method


def test_split_by_range_gives_each_range_its_slice_of_the_sorted_selection():
  idx = helpers.distinct_causal_indices(5, 2, 40, 12)
  ordered, lo, hi = split_by_range(idx, 40, 16)
  chex.assert_equal_shape([ordered, idx])
  chex.assert_shape([lo, hi], (2, 40, 3))
  for b in range(2):
    for t in range(40):
      chosen = sorted(int(i) for i in idx[b, t] if i >= 0)
      row = [int(i) for i in ordered[b, t]]
      assert row == chosen + [-1] * (12 - len(chosen))
      for r in range(3):
        part = row[int(lo[b, t, r]):int(hi[b, t, r])]
        assert part == [i for i in chosen if 16 * r <= i < 16 * (r + 1)]


@pytest.mark.parametrize("selection, queries_per_program, block_k",
                         [("sort", 1, 128), ("threshold", 1, 128), ("kernel", 1, 32),
                          ("kernel", 4, 128)])  # 150 queries: a partial last program
def test_kernel_topk_equals_lax_top_k_over_materialised_scores(selection, queries_per_program,
                                                               block_k):
  q_idx, k_idx, w, seg = helpers.integer_indexer_inputs(13, 2, 150, 2, 16)
  for segment_ids in (None, seg):
    got = jax.jit(
        lambda a, b, c, s: topk_indices(a, b, c, top_k=20, segment_ids=s, selection=selection,
                                        queries_per_program=queries_per_program, block_k=block_k))(
                                            q_idx, k_idx, w, segment_ids)
    want = helpers.materialised_topk(q_idx, k_idx, w, 20, segment_ids)
    # The selection is a set: compare sorted rows (ties must pick the same keys).
    np.testing.assert_array_equal(jnp.sort(got, -1), jnp.sort(want, -1))


def test_kernel_topk_pads_with_minus_one_when_top_k_exceeds_t():
  q_idx, k_idx, w, _ = helpers.integer_indexer_inputs(14, 1, 20, 2, 16)
  got = jax.jit(lambda *a: topk_indices(*a, top_k=24))(q_idx, k_idx, w)
  assert got.shape == (1, 20, 24)
  np.testing.assert_array_equal((got >= 0).sum(-1)[0], jnp.arange(1, 21))


@pytest.mark.parametrize("bad, message", [
    (dict(q=jnp.zeros((1, 8, 4, 12))), "power of 2"),
    (dict(k=jnp.zeros((1, 8, 2, 16), jnp.bfloat16), v=jnp.zeros(
        (1, 8, 2, 16), jnp.bfloat16)), "share a dtype"),
    (dict(indices=jnp.zeros((8, 4), jnp.int32)), "indices must have shape"),
    (dict(dkdv="scatter"), "dkdv must be one of"),
    (dict(keys_per_range=0), "keys_per_range must be positive"),
])
def test_kernel_attention_rejects_bad_inputs(bad, message):
  args = dict(q=jnp.zeros((1, 8, 4, 16)), k=jnp.zeros((1, 8, 2, 16)), v=jnp.zeros((1, 8, 2, 16)),
              indices=jnp.zeros((1, 8, 4), jnp.int32))
  args.update(bad)
  if "q" in bad:
    args["k"] = args["v"] = jnp.zeros((1, 8, 2, 12))
  with pytest.raises(ValueError, match=message):
    sparse_attention(**args)


def test_kernel_attention_rejects_inputs_past_int32_offsets():
  # Shapes only (nothing is allocated): the grouped q would hold 2**32 elements.
  q = jax.ShapeDtypeStruct((4, 2**17, 64, 64), jnp.float32)
  kv = jax.ShapeDtypeStruct((4, 2**17, 8, 64), jnp.float32)
  indices = jax.ShapeDtypeStruct((4, 2**17, 4), jnp.int32)
  with pytest.raises(ValueError, match="too large for the Pallas kernels"):
    sparse_attention(q, kv, kv, indices)


def test_kernel_topk_rejects_bad_inputs():
  with pytest.raises(ValueError, match="q_idx must have shape"):
    topk_indices(jnp.zeros((8, 2, 16)), jnp.zeros((1, 8, 16)), jnp.zeros((1, 8, 2)), top_k=4)
  with pytest.raises(ValueError, match="k_idx dtype"):
    topk_indices(jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 8, 16), jnp.bfloat16), jnp.zeros(
        (1, 8, 2)), top_k=4)
  with pytest.raises(ValueError, match="selection must be one of"):
    topk_indices(jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 8, 16)), jnp.zeros((1, 8, 2)), top_k=4,
                 selection="heap")
  with pytest.raises(ValueError, match="queries_per_program must be a power of 2"):
    topk_indices(jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 8, 16)), jnp.zeros((1, 8, 2)), top_k=4,
                 queries_per_program=3)
  with pytest.raises(ValueError, match="block_k must be a power of 2"):
    topk_indices(jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 8, 16)), jnp.zeros((1, 8, 2)), top_k=4,
                 block_k=48)


def test_the_atomic_backward_runs_with_relaxed_atomics():
  from pallas_kernels.sparse_attention import relaxed_atomics
  q, k, v, do = helpers.attention_inputs(3, 1, 16, 2, 1, 16)
  idx = helpers.distinct_causal_indices(4, 1, 16, 8)
  helpers.vjp(lambda *a: sparse_attention(*a, dkdv="atomic"), q, k, v, idx, do)
  assert relaxed_atomics.enabled()

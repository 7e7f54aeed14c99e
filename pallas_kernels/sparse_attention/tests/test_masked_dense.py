"""Masked dense attention and the density choice against the gather reference."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.sparse_attention import by_density
from pallas_kernels.sparse_attention.reference import sparse_attention_reference
from pallas_kernels.sparse_attention.masked_dense import masked_dense_attention, selection_mask
from pallas_kernels.sparse_attention.tests import helpers


def test_selection_mask_marks_exactly_the_valid_indices():
  idx = helpers.distinct_causal_indices(3, 2, 24, 8)
  mask = selection_mask(idx, 24)
  assert mask.shape == (2, 1, 24, 24)
  want = jnp.zeros((2, 24, 24), bool)
  for b in range(2):
    for t in range(24):
      for s in idx[b, t].tolist():
        if s >= 0:
          want = want.at[b, t, s].set(True)
  assert bool(jnp.array_equal(mask[:, 0], want))


def test_masked_dense_matches_the_gather_reference_fp32():
  q, k, v, do = helpers.attention_inputs(21, 2, 48, 8, 2, 16, dtype=jnp.float32)
  idx = helpers.distinct_causal_indices(22, 2, 48, 12)
  idx = idx.at[:, 5].set(-1)  # a query with no key at all outputs zeros
  want = helpers.vjp(sparse_attention_reference, q, k, v, idx, do)
  got = helpers.vjp(masked_dense_attention, q, k, v, idx, do)
  assert float(jnp.abs(got[0][:, 5]).max()) == 0.0
  for g, w in zip(got, want):
    assert helpers.rel_err(g, w) <= 1e-5


def test_masked_dense_keeps_selected_keys_past_the_query():
  # the contract allows any key; such a selection must not take the causal pass
  q, k, v, do = helpers.attention_inputs(27, 1, 32, 4, 2, 16, dtype=jnp.float32)
  keys = jax.random.split(jax.random.key(28), 32)
  idx = jax.vmap(lambda kk: jax.random.permutation(kk, 32)[:8])(keys)[None].astype(jnp.int32)
  assert bool(jnp.any(idx > jnp.arange(32)[None, :, None]))
  want = helpers.vjp(sparse_attention_reference, q, k, v, idx, do)
  got = helpers.vjp(masked_dense_attention, q, k, v, idx, do)
  for g, w in zip(got, want):
    assert helpers.rel_err(g, w) <= 1e-5


def test_masked_dense_takes_every_key_of_a_query_range():
  # a device holding queries [16, 48) of a 48-token sequence passes all 48 keys
  q, k, v, do = helpers.attention_inputs(23, 1, 48, 4, 2, 16, dtype=jnp.float32)
  idx = helpers.distinct_causal_indices(24, 1, 48, 16)[:, 16:]
  args = (q[:, 16:], k, v, idx, do[:, 16:])
  want = helpers.vjp(sparse_attention_reference, *args)
  got = helpers.vjp(masked_dense_attention, *args)
  for g, w in zip(got, want):
    assert helpers.rel_err(g, w) <= 1e-5


def test_density_choice_follows_the_cost_model():
  q8k, kv8k = (1, 8192, 64, 128), (1, 8192, 8, 128)
  assert by_density.prefers_dense(q8k, kv8k, 2048, jnp.bfloat16)
  assert not by_density.prefers_dense(q8k, kv8k, 2048, jnp.float32)  # no fused fp32 kernel
  assert not by_density.prefers_dense(q8k, kv8k, 64, jnp.bfloat16)  # too sparse
  long_q, long_kv = (1, 32768, 64, 128), (1, 32768, 8, 128)
  assert not by_density.prefers_dense(long_q, long_kv, 2048, jnp.bfloat16)


@pytest.mark.parametrize("dense", [True, False])
def test_both_choices_match_the_reference_bf16(dense, monkeypatch):
  if not dense:
    monkeypatch.setattr(by_density, "MASK_BYTES", 0)
  q, k, v, do = helpers.attention_inputs(25, 1, 40, 4, 1, 32)
  idx = helpers.distinct_causal_indices(26, 1, 40, 20)
  assert by_density.prefers_dense(q.shape, k.shape, 20, q.dtype) == dense
  want = helpers.vjp(sparse_attention_reference, q, k, v, idx, do)
  got = helpers.vjp(by_density.sparse_attention_by_density, q, k, v, idx, do)
  assert helpers.rel_err(got[0], want[0]) <= 5e-3
  for g, w in zip(got[1:], want[1:]):
    assert helpers.rel_err(g, w) <= 1e-2

"""The plain-JAX causal attention reference against a naive softmax attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.causal_attention import causal_attention_reference, cudnn_causal_attention


def _inputs(seed, b, t, h, dk, dv):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, t, h, dk))
  k = jax.random.normal(ks[1], (b, t, h, dk))
  v = jax.random.normal(ks[2], (b, t, h, dv))
  return q, k, v


def _naive(q, k, v, segment_ids, scale):
  """Dense softmax attention in float64 numpy, one query at a time."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, t, h, _ = q.shape
  seg = np.zeros((b, t), np.int64) if segment_ids is None else np.asarray(segment_ids)
  out = np.zeros((b, t, h, v.shape[-1]))
  for bi in range(b):
    for ti in range(t):
      keys = [s for s in range(ti + 1) if seg[bi, s] == seg[bi, ti]]
      logits = np.einsum("hd,shd->hs", q[bi, ti], k[bi, keys]) * scale
      p = np.exp(logits - logits.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      out[bi, ti] = np.einsum("hs,shd->hd", p, v[bi, keys])
  return out


def _packed(b, t):
  """Three documents in row 0 (lengths 11, 1, rest), one in the other rows."""
  seg = np.zeros((b, t), np.int32)
  seg[0, 11:] = 1
  seg[0, 12:] = 2
  return jnp.asarray(seg)


@pytest.mark.parametrize("dk, dv", [(24, 16), (16, 16), (8, 20)])
def test_reference_matches_naive_attention_with_packed_segments(dk, dv):
  b, t, h = 2, 29, 3
  q, k, v = _inputs(0, b, t, h, dk, dv)
  seg = _packed(b, t)
  scale = 0.3
  for segment_ids in (None, seg):
    got = jax.jit(lambda q, k, v, s: causal_attention_reference(q, k, v, segment_ids=s, scale=scale,
                                                                block_q=8))(q, k, v, segment_ids)
    assert got.shape == (b, t, h, dv)
    np.testing.assert_allclose(got, _naive(q, k, v, segment_ids, scale), rtol=1e-5, atol=1e-5)


def test_default_scale_is_the_key_head_dim():
  q, k, v = _inputs(1, 1, 9, 2, 16, 8)
  got = causal_attention_reference(q, k, v, block_q=4)
  np.testing.assert_allclose(got, _naive(q, k, v, None, 16**-0.5), rtol=1e-5, atol=1e-5)


def test_gradients_match_dense_attention():
  b, t, h, dk, dv = 1, 21, 2, 16, 12
  q, k, v = _inputs(2, b, t, h, dk, dv)
  seg = _packed(b, t)
  do = jax.random.normal(jax.random.key(3), (b, t, h, dv))

  def dense(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * dk**-0.5
    ok = (jnp.tril(jnp.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :]))[:, None]
    p = jax.nn.softmax(jnp.where(ok, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)

  blocked = lambda q, k, v: causal_attention_reference(q, k, v, segment_ids=seg, block_q=5)
  got = jax.vjp(blocked, q, k, v)[1](do)
  want = jax.vjp(dense, q, k, v)[1](do)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_fused_path_falls_back_to_the_reference_where_cudnn_cannot_run():
  # fp32 inputs (and any input on CPU through `auto`) take the reference
  q, k, v = _inputs(4, 1, 13, 2, 24, 16)
  seg = _packed(1, 13)
  got = cudnn_causal_attention(q, k, v, segment_ids=seg, block_q=4)
  np.testing.assert_allclose(got, _naive(q, k, v, seg, 24**-0.5), rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_argument():
  q, k, v = _inputs(5, 1, 8, 2, 16, 8)
  with pytest.raises(ValueError, match="k must have the shape of q"):
    causal_attention_reference(q, k[:, :, :1], v)
  with pytest.raises(ValueError, match="v must have shape"):
    causal_attention_reference(q, k, v[:, :4])
  with pytest.raises(ValueError, match="segment_ids"):
    causal_attention_reference(q, k, v, segment_ids=jnp.zeros((1, 7), jnp.int32))

"""chunked_cross_entropy against the naive fp32-logits reference, values and gradients."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cross_entropy import chunked_cross_entropy, cross_entropy_reference

N, D, V = 37, 24, 101  # neither N nor V a multiple of anything used below


def random_inputs(seed, n=N, d=D, v=V, dtype=jnp.float32, ignored=0.2):
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  hidden = jax.random.normal(k1, (n, d), dtype)
  lm_head = (jax.random.normal(k2, (d, v), jnp.float32) * 0.3).astype(dtype)
  labels = jax.random.randint(k3, (n,), 0, v)
  labels = jnp.where(jax.random.uniform(k4, (n,)) < ignored, -100, labels)
  return hidden, lm_head, labels


def assert_close(actual, expected, tol):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert np.all(np.isfinite(actual))
  err = np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)
  assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("token_chunk,logits_chunk", [(16, 8), (64, 64)])
def test_loss_and_gradients_match_reference(z_loss, token_chunk, logits_chunk):
  hidden, lm_head, labels = random_inputs(int(z_loss * 100) + token_chunk)
  assert int(jnp.sum(labels == -100)) > 0
  opts = dict(z_loss=z_loss)
  chunks = dict(token_chunk=token_chunk, logits_chunk=logits_chunk)
  loss, count = jax.jit(lambda h, w: chunked_cross_entropy(h, w, labels, **chunks, **opts))(hidden,
                                                                                            lm_head)
  ref_loss, ref_count = cross_entropy_reference(hidden, lm_head, labels, **opts)
  assert count.dtype == jnp.int32 and int(count) == int(ref_count)
  assert loss.dtype == jnp.float32
  assert_close(loss, ref_loss, 1e-5)

  # A mean loss: the incoming cotangent is not 1, so the backward scale is exercised.
  def mean_loss(f, **kw):
    return lambda h, w: (lambda s, c: s / c)(*f(h, w, labels, **opts, **kw))

  got = jax.jit(jax.grad(mean_loss(chunked_cross_entropy, **chunks), argnums=(0, 1)))(hidden,
                                                                                      lm_head)
  want = jax.grad(mean_loss(cross_entropy_reference), argnums=(0, 1))(hidden, lm_head)
  for g, w in zip(got, want):
    assert_close(g, w, 1e-5)
  ignored_rows = np.asarray(labels == -100)
  np.testing.assert_array_equal(np.asarray(got[0])[ignored_rows], 0.0)


def test_gradient_of_hidden_alone_and_custom_ignore_index():
  hidden, lm_head, labels = random_inputs(7)
  labels = jnp.where(labels == -100, 5, labels)  # ignore label 5 instead
  f = lambda fn, **kw: (lambda h: fn(h, lm_head, labels, ignore_index=5, **kw)[0])
  got = jax.grad(f(chunked_cross_entropy, token_chunk=16, logits_chunk=4))(hidden)
  assert_close(got, jax.grad(f(cross_entropy_reference))(hidden), 1e-5)


def test_bf16_inputs_match_reference():
  hidden, lm_head, labels = random_inputs(8, dtype=jnp.bfloat16)
  f = lambda fn, **kw: (lambda h, w: fn(h, w, labels, **kw)[0])
  assert_close(
      f(chunked_cross_entropy, token_chunk=16)(hidden, lm_head),
      f(cross_entropy_reference)(hidden, lm_head), 1e-3)
  got = jax.grad(f(chunked_cross_entropy, token_chunk=16), argnums=(0, 1))(hidden, lm_head)
  want = jax.grad(f(cross_entropy_reference), argnums=(0, 1))(hidden, lm_head)
  chex.assert_type(got, jnp.bfloat16)
  for g, w in zip(got, want):
    assert_close(g, w, 2e-2)


def test_temporary_memory_far_below_naive_at_32k_vocab():
  hidden, lm_head, labels = random_inputs(9, n=256, d=32, v=32768)

  def temp_bytes(fn, **kw):
    grad = jax.grad(lambda h, w: fn(h, w, labels, **kw)[0], argnums=(0, 1))
    compiled = jax.jit(grad).lower(hidden, lm_head).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  naive = temp_bytes(cross_entropy_reference)
  chunked = temp_bytes(chunked_cross_entropy, token_chunk=32, logits_chunk=8)
  assert naive >= 256 * 32768 * 4  # the [N, V] fp32 logits
  assert chunked < naive / 4, (chunked, naive)


def test_bad_inputs_raise_clear_errors():
  hidden, lm_head, labels = random_inputs(10)
  with pytest.raises(ValueError, match=r"labels must lie in \[0, 101\)"):
    chunked_cross_entropy(hidden, lm_head, labels.at[3].set(V))
  with pytest.raises(ValueError, match="labels must lie"):
    chunked_cross_entropy(hidden, lm_head, labels.at[0].set(-1))
  with pytest.raises(ValueError, match="hidden has D=24"):
    chunked_cross_entropy(hidden, lm_head[:20], labels)
  with pytest.raises(ValueError, match="labels has 36 entries"):
    chunked_cross_entropy(hidden, lm_head, labels[:36])
  with pytest.raises(ValueError, match="lm_head must have shape"):
    chunked_cross_entropy(hidden, lm_head[None], labels)
  with pytest.raises(ValueError, match="token_chunk"):
    chunked_cross_entropy(hidden, lm_head, labels, token_chunk=0)
  with pytest.raises(ValueError, match="must be a multiple of logits_chunk=12"):
    chunked_cross_entropy(hidden, lm_head, labels, token_chunk=16, logits_chunk=12)

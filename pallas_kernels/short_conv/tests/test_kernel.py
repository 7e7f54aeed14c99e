"""The fused short convolution + SiLU (+ L2 norm) against the plain-JAX reference, forward
and backward, on fresh random inputs: documents that start on a block boundary, one token
after it, one token long, an id repeated after a different one; several blocks, so that
the halos on both sides are read. Both backward forms of the blocks, and the rows form."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.short_conv import short_conv_silu, short_conv_silu_reference
from pallas_kernels.short_conv.reference import token_reach


def _inputs(B, T, H, D, taps, dtype, seed):
  kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (B, T, H, D), jnp.float32).astype(dtype)
  w = taps**-0.5 * jax.random.normal(kw, (H, D, taps), jnp.float32)
  seg = np.zeros((B, T), np.int32)
  for start, doc in ((64, 1), (65, 2), (66, 3), (97, 1), (T - 1, 4)):
    if start < T:  # a block boundary, one token after it, a one-token document, id 1 again
      seg[0, start:] = doc
  return x, w, jnp.asarray(seg), jax.random.normal(kc, (B, T, H, D), jnp.float32)


def _value_and_grads(fn, x, w, seg, probe, normalize):
  loss = lambda x, w: jnp.sum(fn(x, w, seg, normalize=normalize).astype(jnp.float32) * probe)
  out = jax.jit(lambda x, w: fn(x, w, seg, normalize=normalize))(x, w)
  return (out, *jax.jit(jax.grad(loss, (0, 1)))(x, w))


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.sqrt(np.mean((a - b)**2) / np.mean(b**2))


@pytest.mark.parametrize("form,backward", [("blocks", "one_kernel"), ("blocks", "two_kernels"),
                                           ("rows", "two_kernels")])
@pytest.mark.parametrize("T,taps,normalize,blocks", [(192, 4, True, (None, None)),
                                                     (48, 3, False, (None, None)),
                                                     (128, 2, True, (64, 16))])
def test_fp32_matches_the_reference_forward_and_backward(T, taps, normalize, blocks, backward,
                                                         form):
  x, w, seg, probe = _inputs(2, T, 2, 32, taps, jnp.float32, seed=T + taps)
  fused = functools.partial(short_conv_silu, block_tokens=blocks, backward=backward, form=form)
  got = _value_and_grads(fused, x, w, seg, probe, normalize)
  want = _value_and_grads(short_conv_silu_reference, x, w, seg, probe, normalize)
  for name, a, b in zip(("out", "dx", "dw"), got, want):
    assert _rel(a, b) < 2e-5, name


@pytest.mark.parametrize("form", ["blocks", "rows"])
def test_bf16_is_as_close_to_fp32_as_the_xla_path(form):
  """The fused kernels keep the norm's and SiLU's gradients in fp32 where the XLA path
    rounds them to bf16: against the fp32 computation they are no further than that path."""
  x, w, seg, probe = _inputs(1, 128, 2, 64, 4, jnp.bfloat16, seed=7)
  truth = _value_and_grads(short_conv_silu_reference, x.astype(jnp.float32), w, seg, probe, True)
  got = _value_and_grads(functools.partial(short_conv_silu, form=form), x, w, seg, probe, True)
  xla = _value_and_grads(short_conv_silu_reference, x, w, seg, probe, True)
  assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.bfloat16
  for name, a, b, t in zip(("out", "dx", "dw"), got, xla, truth):
    assert _rel(a, t) < 1e-2 and _rel(a, t) <= 1.2 * _rel(b, t) + 1e-4, name


def test_the_two_backward_forms_agree_in_bf16_and_a_bad_one_is_named():
  x, w, seg, probe = _inputs(1, 96, 2, 32, 4, jnp.bfloat16, seed=11)
  one, two = (_value_and_grads(functools.partial(short_conv_silu, backward=form), x, w, seg, probe,
                               True) for form in ("one_kernel", "two_kernels"))
  np.testing.assert_array_equal(one[0], two[0])  # the same forward
  assert two[1].dtype == jnp.bfloat16
  for name, a, b in zip(("dx", "dw"), one[1:], two[1:]):
    assert _rel(a, b) < 1e-2, name
  with pytest.raises(ValueError, match="backward='two_kernel'"):
    short_conv_silu(x, w, seg, backward="two_kernel")
  with pytest.raises(ValueError, match="form='row'"):
    short_conv_silu(x, w, seg, form="row")


def test_reach_counts_earlier_tokens_of_the_same_document():
  seg = jnp.asarray([[0, 0, 0, 0, 0, 1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(token_reach(seg, 1, 10, 4), [[0, 1, 2, 3, 3, 0, 1, 0, 1, 2]])
  np.testing.assert_array_equal(token_reach(None, 2, 5, 3), [[0, 1, 2, 2, 2]] * 2)


def test_lengths_off_the_block_run_the_reference_and_bad_weights_are_named():
  x, w, seg, _ = _inputs(1, 40, 1, 16, 4, jnp.float32, seed=3)
  np.testing.assert_array_equal(short_conv_silu(x, w, seg), short_conv_silu_reference(x, w, seg))
  with pytest.raises(ValueError, match="does not match"):
    short_conv_silu(x, w[:, :8], seg)
  with pytest.raises(ValueError, match="block_tokens=24"):
    short_conv_silu(x[:, :32], w, seg[:, :32], block_tokens=(24, None))

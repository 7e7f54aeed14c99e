"""pallas_kernels.short_conv.reference: the causal depthwise convolution never reads across a
document boundary, and on a sequence split over devices XLA exchanges only a
(K-1)-token halo between neighbours (no gather of the whole sequence)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from hylora.core.config import MeshConfig
from pallas_kernels.short_conv.reference import causal_depthwise_conv
from meshes.mesh import build_mesh
from meshes.rules import activation_mesh, constrain
from pallas_kernels.linear_attention._inputs import run_ids

K = 4
PER_DEVICE = 16


def _oracle(x, w, seg):
  """y[t] = sum over taps s of w[..., K-1-s] x[t-s] where t-s is in t's run, in numpy."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  b, t = x.shape[:2]
  runs = np.asarray(run_ids(seg, b, t))
  y = np.zeros_like(x)
  for i in range(b):
    for j in range(t):
      for s in range(K):
        if j - s >= 0 and runs[i, j - s] == runs[i, j]:
          y[i, j] += x[i, j - s] * w[..., K - 1 - s]
  return y


def _inputs(b, t):
  x = jax.random.normal(jax.random.key(0), (b, t, 2, 8), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (2, 8, K), jnp.float32)
  seg = np.zeros((b, t), np.int32)
  r = PER_DEVICE
  seg[0, 2 * r:] = 1  # a new document exactly at a device boundary
  seg[0, 3 * r - 1:] = 2  # one on the last token of a range: its taps reach into the next
  seg[0, 3 * r + 1:] = 3  # one token into a range: the halo holds the previous document
  seg[0, 5 * r + 2:] = 2  # an id seen before, after a different one: a new document
  return x, w, jnp.asarray(seg)


def test_taps_stay_inside_their_document():
  x, w, seg = _inputs(2, 8 * PER_DEVICE)
  np.testing.assert_allclose(np.asarray(causal_depthwise_conv(x, w, seg)), _oracle(x, w, seg),
                             rtol=1e-5, atol=1e-5)


def test_split_sequence_exchanges_a_halo_and_matches_the_whole_sequence():
  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  x, w, seg = _inputs(1, 8 * PER_DEVICE)
  tokens = NamedSharding(mesh, P(None, ("fsdp", "expert")))
  names = ("batch", "seq", "heads", "head_dim")

  def conv(x, w, seg):
    with activation_mesh(mesh):
      return constrain(causal_depthwise_conv(constrain(x, names), w, seg), names)

  def loss(x, w, seg):
    return jnp.sum(jnp.sin(conv(x, w, seg)))

  placed = jax.device_put(x, tokens), w, jax.device_put(seg, tokens)
  forward = jax.jit(conv)
  backward = jax.jit(jax.grad(loss, (0, 1)))
  for compiled in (forward.lower(*placed).compile(), backward.lower(*placed).compile()):
    hlo = compiled.as_text()
    assert "collective-permute" in hlo and "all-gather" not in hlo and "all-to-all" not in hlo
  np.testing.assert_allclose(np.asarray(forward(*placed)), _oracle(x, w, seg), rtol=1e-5, atol=1e-5)
  want = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(causal_depthwise_conv(*a))), (0, 1)))(x, w,
                                                                                           seg)
  for got, expected in zip(backward(*placed), want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)

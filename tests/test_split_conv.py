"""meshes.split_conv: the KDA prologue's short convolution (the registered Pallas kernel,
interpreted) on a sequence split over devices equals it on the whole sequence, outputs and
gradients of x and the weight, documents crossing the devices' boundaries or not; the
halo passes by `ppermute`, never an all-gather."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from hylora.core.config import MeshConfig
from hylora.ops import catalog
from meshes.mesh import build_mesh
from meshes.per_shard import sequence_split
from meshes.rules import activation_mesh
from meshes.split_conv import HALO, causal_conv_over_devices
from pallas_kernels.short_conv import short_conv_silu_reference

H, D, TAPS = 2, 16, 4
PER_DEVICE = 32


def _segments(t):
  """A document starting exactly at the third range's first token, one starting two tokens
  into the fourth and running over the next three ranges, and an id seen before after a
  different one (a new document) at the eighth range."""
  seg = np.ones((1, t), np.int32)
  r = PER_DEVICE
  seg[0, 2 * r:] = 2
  seg[0, 3 * r + 2:] = 3
  seg[0, 7 * r:] = 1
  return jnp.asarray(seg)


@pytest.mark.parametrize("shape, with_ids", [((1, 8), True), ((2, 4), True), ((1, 8), False)])
def test_split_sequence_matches_whole_sequence(shape, with_ids):
  mesh = build_mesh(MeshConfig(fsdp=shape[0], expert=shape[1]))
  T = PER_DEVICE * mesh.size
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (1, T, H, D), jnp.float32)
  w = jax.random.normal(keys[1], (H, D, TAPS), jnp.float32) / TAPS
  probe = jax.random.normal(keys[2], x.shape)
  seg = _segments(T) if with_ids else None
  kernel = catalog().resolve("short_conv", "pallas")

  def value_and_grads(fn):

    def run(x, w):
      out, pullback = jax.vjp(lambda x, w: fn(x, w, seg, normalize=True), x, w)
      return out, pullback(probe)

    return run

  want, want_grads = jax.jit(value_and_grads(short_conv_silu_reference))(x, w)
  with activation_mesh(mesh):
    split = sequence_split(x)
  assert split is not None and split[2] is not None  # the sequence is split
  placed = jax.device_put(x, NamedSharding(mesh, P(split[1], split[2])))

  def under_mesh(x, w):
    with activation_mesh(mesh):
      return value_and_grads(kernel)(x, w)

  traced = jax.jit(under_mesh).trace(placed, w)
  jaxpr = str(traced.jaxpr)
  assert "all_gather" not in jaxpr
  # forward: the halo and its ids; backward: the halo's gradient back
  assert jaxpr.count("ppermute[") == 3, jaxpr.count("ppermute[")
  got, grads = traced.lower().compile()(placed, w)
  for name, a, b in zip(("out", "dx", "dw"), (got, *grads), (want, *want_grads)):
    scale = float(jnp.max(jnp.abs(b)))
    np.testing.assert_allclose(
        np.asarray(a) / scale,
        np.asarray(b) / scale, rtol=0, atol=1e-5, err_msg=name)


def test_taps_past_the_halo_and_ranges_shorter_than_it_are_named():
  mesh = build_mesh(MeshConfig(fsdp=1, expert=8))
  wrapped = causal_conv_over_devices(short_conv_silu_reference)
  x = jnp.zeros((1, PER_DEVICE * 8, H, D))
  with activation_mesh(mesh):
    with pytest.raises(ValueError, match=f"reach past the {HALO}-token halo"):
      wrapped(x, jnp.zeros((H, D, HALO + 2)))
    with pytest.raises(ValueError, match="8 tokens a device, fewer than the 16-token halo"):
      wrapped(x[:, :64], jnp.zeros((H, D, TAPS)))

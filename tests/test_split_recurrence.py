"""meshes.split_recurrence: a linear recurrence over a sequence split across devices
equals the recurrence on the whole sequence, outputs, final state and gradients; the
state passes by a logarithmic scan of `ppermute`s, never an all-gather."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from hylora.core.config import MeshConfig
from hylora.ops import catalog
from meshes.mesh import build_mesh
from meshes.per_shard import sequence_axes, sequence_split
from meshes.rules import activation_mesh
from meshes.split_recurrence import compose, scan_rounds, split_recurrence_over_devices
from pallas_kernels.linear_attention.reference import gla_chunked, kda_chunked

H, D = 2, 16
PER_DEVICE = 64


def _segments(b, t):
  """Row 0: a new document exactly at the third range's first token, one inside the
  fourth range that runs over the next three ranges, and one more at a range boundary;
  the other rows: one inside the first range, and none."""
  seg = np.ones((b, t), np.int32)
  r = PER_DEVICE
  seg[0, 2 * r:] = 2
  seg[0, 3 * r + 10:] = 3  # spans ranges 3, 4, 5 and 6
  seg[0, 7 * r:] = 1  # an id seen before, after a different one: a new document
  if b > 1:
    seg[1, 7:] = 4
  return jnp.asarray(seg)


def _inputs(b, t, with_beta, seed=0):
  keys = jax.random.split(jax.random.key(seed), 8)
  q, k, v = (jax.random.normal(key, (b, t, H, D), jnp.float32) for key in keys[:3])
  g = jnp.maximum(jax.nn.log_sigmoid(2.0 * jax.random.normal(keys[3], (b, t, H, D))), -20.0)
  # strong decays in a quarter of the channels (-3 to -5 per token) and mild ones in
  # another (down to -0.02: a state that outlives a range and reaches the next ones)
  strong = jax.random.uniform(keys[6], (b, t, H, D // 4), jnp.float32, -5.0, -3.0)
  mild = jax.random.uniform(keys[7], (b, t, H, D // 4), jnp.float32, -0.02, 0.0)
  g = g.at[..., :D // 4].set(strong).at[..., D // 4:D // 2].set(mild)
  beta = (jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, H))),) if with_beta else ()
  h0 = jax.random.normal(keys[5], (b, H, D, D), jnp.float32)
  return (q, k, v, g, *beta), h0, _segments(b, t)


def _loss(fn, args, h0, seg, probe):
  o, final = fn(*args, initial_state=h0, segment_ids=seg, output_final_state=True)
  return jnp.sum(o * probe[0]) + jnp.sum(final * probe[1])


KERNELS = {
    ("gla", "reference"):
        lambda: split_recurrence_over_devices(gla_chunked),
    ("kda", "reference"):
        lambda: split_recurrence_over_devices(kda_chunked),
    # the registered kernels, wrapped by the registry (interpreted on CPU)
    ("gla", "pallas"):
        lambda: catalog().resolve("linear_attention.gla", "pallas"),
    ("kda", "pallas"):
        lambda: catalog().resolve("linear_attention.kda", "pallas"),
}
# (fsdp, expert), batch: the sequence over one axis of 8, over both axes of 2 x 4, and
# over one axis with the batch over the other
MESHES = {"one_axis": ((1, 8), 1), "both_axes": ((2, 4), 1), "with_batch": ((4, 2), 2)}


@pytest.mark.parametrize("mesh_name", ["one_axis", "both_axes"])
@pytest.mark.parametrize("kind", ["gla", "kda"])
def test_split_sequence_matches_whole_sequence(kind, mesh_name):
  _check_against_whole_sequence(kind, "reference", mesh_name)


# the kernels once each (interpreted: slow to compile), on the two-axis split
@pytest.mark.parametrize("kind", ["gla", "kda"])
def test_split_pallas_kernels_match_whole_sequence(kind):
  _check_against_whole_sequence(kind, "pallas", "both_axes")


def test_split_sequence_with_split_batch():
  _check_against_whole_sequence("gla", "reference", "with_batch")


def _check_against_whole_sequence(kind, impl, mesh_name):
  shape, batch = MESHES[mesh_name]
  mesh = build_mesh(MeshConfig(fsdp=shape[0], expert=shape[1]))
  fn = KERNELS[kind, impl]()
  args, h0, seg = _inputs(batch, PER_DEVICE * mesh.size // batch, kind == "kda")
  with activation_mesh(mesh):
    split = sequence_split(args[0])
  assert split is not None and split[2] is not None  # the sequence is split
  axes = sequence_axes(split[2])
  assert len(axes) == (2 if mesh_name == "both_axes" else 1)
  n = int(np.prod([mesh.shape[a] for a in axes]))
  probe = (jax.random.normal(jax.random.key(9),
                             args[2].shape), jax.random.normal(jax.random.key(10), h0.shape))

  def value_and_grads(*xs):
    # the gradients of sum(o * probe[0]) + sum(final * probe[1]), one forward pass
    out, pullback = jax.vjp(
        lambda *ys: fn(*ys[:-1], initial_state=ys[-1], segment_ids=seg, output_final_state=True),
        *xs)
    return out, pullback(probe)

  # the whole sequence on one device (no mesh), compiled as one program
  (want_o, want_final), want_grads = jax.jit(value_and_grads)(*args, h0)

  spec = NamedSharding(mesh, P(split[1], split[2]))
  placed = tuple(jax.device_put(a, spec) for a in args)

  def under_mesh(*xs):
    with activation_mesh(mesh):
      return value_and_grads(*xs)

  traced = jax.jit(under_mesh).trace(*placed, h0)
  jaxpr = str(traced.jaxpr)
  assert "all_gather" not in jaxpr
  # forward: the scan's rounds, the previous device's last segment id, the shift by one
  # device; backward: the reverse of each but the segment ids'
  rounds = len(scan_rounds(n))
  assert jaxpr.count("ppermute[") == (rounds + 2) + (rounds + 1), jaxpr.count("ppermute[")
  (o, final), grads = traced.lower().compile()(*placed, h0)

  names = ["o", "final"] + ["q", "k", "v", "g", "beta"][:len(args)] + ["initial_state"]
  for name, got, want in zip(names, (o, final, *grads), (want_o, want_final, *want_grads)):
    scale = float(jnp.max(jnp.abs(want)))
    assert scale > 0, name
    np.testing.assert_allclose(
        np.asarray(got) / scale,
        np.asarray(want) / scale, rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("dv, widths", [(16, [32, 16]), (32, [16, 32, 32])])
def test_one_widened_pass_or_a_pass_each_where_the_kernel_has_no_tiles(dv, widths):
  """[M | L] in one pass of Dk + Dv value channels; where the Pallas kernel refuses that
  width (16 + 32: not a power of two), M and L in a pass each, the outputs unchanged."""
  from pallas_kernels.linear_attention import chunked_gla
  mesh = build_mesh(MeshConfig(fsdp=1, expert=8))
  seen = []

  def recording(q, k, v, g, **kwargs):
    out = chunked_gla(q, k, v, g, **kwargs)  # raises before recording a refused width
    seen.append(v.shape[-1])
    return out

  (q, k, _, g), h0, seg = _inputs(1, PER_DEVICE * 8, False)
  v = jax.random.normal(jax.random.key(4), (1, PER_DEVICE * 8, H, dv))
  h0 = jnp.zeros((1, H, D, dv))
  want = jax.jit(lambda *xs: chunked_gla(*xs, initial_state=h0, segment_ids=seg)[0])(q, k, v, g)
  wrapped = split_recurrence_over_devices(recording)

  @jax.jit
  def run(*xs):
    with activation_mesh(mesh):
      return wrapped(*xs, initial_state=h0, segment_ids=seg)[0]

  got = run(q, k, v, g)
  assert seen == widths
  scale = float(jnp.max(jnp.abs(want)))
  np.testing.assert_allclose(np.asarray(got) / scale, np.asarray(want) / scale, atol=1e-5)


def test_compose_is_the_map_of_one_range_then_the_next():
  keys = jax.random.split(jax.random.key(0), 5)
  a = (jax.random.normal(keys[0], (3, D, D)), jax.random.normal(keys[1], (3, D, 8)))
  b = (jax.random.normal(keys[2], (3, D, D)), jax.random.normal(keys[3], (3, D, 8)))
  s = jax.random.normal(keys[4], (3, D, 8))
  apply = lambda f, s: jnp.einsum("bij,bjv->biv", f[0], s, precision="highest") + f[1]
  m, l = compose(a, b)
  np.testing.assert_allclose(np.asarray(apply((m, l), s)), np.asarray(apply(b, apply(a, s))),
                             rtol=1e-5, atol=1e-4)
  assert scan_rounds(1) == [] and scan_rounds(8) == [1, 2, 4] and scan_rounds(128)[-1] == 64
  assert len(scan_rounds(5)) == 3


def test_whole_sequences_per_device_take_the_row_path():
  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  args, _, seg = _inputs(8, 64, False)
  with activation_mesh(mesh):
    assert sequence_split(args[0]) is None  # 8 sequences: one per device
  wrapped = split_recurrence_over_devices(gla_chunked)

  @jax.jit
  def run(*xs):
    with activation_mesh(mesh):
      return wrapped(*xs, segment_ids=seg)[0]

  np.testing.assert_allclose(np.asarray(run(*args)),
                             np.asarray(gla_chunked(*args, segment_ids=seg)[0]), rtol=1e-5,
                             atol=1e-5)
  jaxpr = str(jax.make_jaxpr(run)(*args))
  assert "shard_map" in jaxpr and "all_gather" not in jaxpr and "ppermute" not in jaxpr


def test_unknown_per_shard_mode_is_refused():
  with pytest.raises(ValueError, match="per_shard"):
    catalog().register("linear_attention.gla", "other", gla_chunked, per_shard="columns")


@pytest.mark.parametrize("mesh_shape, batch", [((2, 4), 1), ((2, 1), H)])
def test_the_decay_gate_goes_whole_to_every_device(mesh_shape, batch):
  """KDA given the gate projection and its DecayGate: on a sequence split over 2 x 4
  devices, and on rows split over 2 devices where the batch equals the heads (a_log's
  length), the outputs and the gradients of f, a_log and dt_bias are the whole sequence's."""
  from pallas_kernels.linear_attention.decay_gate import DecayGate
  mesh = build_mesh(MeshConfig(fsdp=mesh_shape[0], expert=mesh_shape[1]),
                    jax.devices()[:math.prod(mesh_shape)])
  (q, k, v, _, beta), h0, seg = _inputs(batch, PER_DEVICE * 8 // batch, True, seed=3)
  keys = jax.random.split(jax.random.key(11), 4)
  f = 3.0 * jax.random.normal(keys[0], q.shape)
  a_log = jnp.log(jax.random.uniform(keys[1], (H,), minval=1.0, maxval=16.0))
  dt_bias = jax.random.uniform(keys[2], (H, D), minval=-7.0, maxval=-2.0)
  wrapped = split_recurrence_over_devices(kda_chunked)

  def loss(f, a_log, dt_bias, under_mesh):
    decay = DecayGate(a_log, dt_bias, -5.0)
    run = lambda: wrapped(q, k, v, f, beta, initial_state=h0, segment_ids=seg, decay=decay,
                          output_final_state=True)
    if under_mesh:
      with activation_mesh(mesh):
        o, final = run()
    else:
      o, final = run()
    return jnp.sum(jnp.sin(o)) + jnp.sum(jnp.sin(final))

  grads = lambda under_mesh: jax.jit(
      jax.value_and_grad(functools.partial(loss, under_mesh=under_mesh),
                         (0, 1, 2)))(f, a_log, dt_bias)
  (want, want_grads), (got, got_grads) = grads(False), grads(True)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for name, a, b in zip(("f", "a_log", "dt_bias"), got_grads, want_grads):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                               atol=1e-5 * float(jnp.abs(b).max()), err_msg=name)

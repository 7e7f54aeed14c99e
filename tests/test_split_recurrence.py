"""meshes.split_recurrence: a linear recurrence over a sequence split across devices
equals the recurrence on the whole sequence, outputs, final state and gradients."""

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
from meshes.split_recurrence import split_recurrence_over_devices
from pallas_kernels.linear_attention.reference import gla_chunked, kda_chunked

H, D = 2, 16


def _inputs(b, t, with_beta, seed=0):
  keys = jax.random.split(jax.random.key(seed), 6)
  q, k, v = (jax.random.normal(key, (b, t, H, D), jnp.float32) for key in keys[:3])
  g = jnp.maximum(jax.nn.log_sigmoid(2.0 * jax.random.normal(keys[3], (b, t, H, D))), -20.0)
  beta = (jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, H))),) if with_beta else ()
  h0 = jax.random.normal(keys[5], (b, H, D, D), jnp.float32)
  # Row 0: a new segment exactly at the second range's first token and one inside the
  # third; the other rows: inside the first range, and none.
  seg = np.ones((b, t), np.int32)
  seg[0, t // 4:] = 2
  seg[0, t // 2 + 5:] = 3
  if b > 1:
    seg[1, 7:] = 4
  return (q, k, v, g, *beta), h0, jnp.asarray(seg)


def _loss(fn, args, h0, seg, probe):
  o, final = fn(*args, initial_state=h0, segment_ids=seg, output_final_state=True)
  return jnp.sum(o * probe[0]) + jnp.sum(final * probe[1])


@pytest.mark.parametrize("kind, mesh_shape, batch", [("gla", (4, 2), 2), ("kda", (2, 4), 1),
                                                     ("kda", (4, 2), 2)])
def test_split_sequence_matches_whole_sequence_forward_and_gradients(kind, mesh_shape, batch):
  reference = {"gla": gla_chunked, "kda": kda_chunked}[kind]
  mesh = build_mesh(MeshConfig(fsdp=mesh_shape[0], expert=mesh_shape[1]))
  t = 256
  args, h0, seg = _inputs(batch, t, kind == "kda")
  with activation_mesh(mesh):
    split = sequence_split(args[0])
  assert split is not None and split[2] is not None  # the sequence is split
  wrapped = split_recurrence_over_devices(reference)
  probe = (jax.random.normal(jax.random.key(9),
                             args[2].shape), jax.random.normal(jax.random.key(10), h0.shape))
  grad_args = tuple(range(len(args))) + (len(args),)

  def loss_of(fn):
    return lambda *xs: _loss(fn, xs[:-1], xs[-1], seg, probe)

  # The whole sequence on one device, compiled as one program (not op by op).
  @jax.jit
  def whole(*xs):
    out = reference(*xs[:-1], initial_state=xs[-1], segment_ids=seg, output_final_state=True)
    return out, jax.grad(loss_of(reference), grad_args)(*xs)

  (want_o, want_final), want_grads = whole(*args, h0)

  spec = NamedSharding(mesh, P(split[1], split[2]))
  placed = tuple(jax.device_put(a, spec) for a in args)

  @jax.jit
  def run(*xs):
    with activation_mesh(mesh):
      out = wrapped(*xs[:-1], initial_state=xs[-1], segment_ids=seg, output_final_state=True)
      grads = jax.grad(loss_of(wrapped), grad_args)(*xs)
    return out, grads

  (o, final), grads = run(*placed, h0)
  assert "all_gather" in str(jax.make_jaxpr(run)(*placed, h0))
  np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), rtol=2e-4, atol=2e-4)
  np.testing.assert_allclose(np.asarray(final), np.asarray(want_final), rtol=2e-4, atol=2e-4)
  names = ["q", "k", "v", "g", "beta"][:len(args)] + ["initial_state"]
  for name, got, want in zip(names, grads, want_grads):
    scale = float(jnp.max(jnp.abs(want)))
    assert scale > 0, name
    np.testing.assert_allclose(
        np.asarray(got) / scale,
        np.asarray(want) / scale, atol=2e-4, err_msg=name)


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
  assert "shard_map" in jaxpr and "all_gather" not in jaxpr


def test_registered_pallas_kda_passes_state_between_devices():
  kda = catalog().resolve("linear_attention.kda", "pallas")  # interpreted on CPU
  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  args, h0, seg = _inputs(1, 64, True, seed=3)
  want = jax.jit(lambda *xs: kda(*xs, initial_state=h0, segment_ids=seg)[0])(*args)

  @jax.jit
  def run(*xs):
    with activation_mesh(mesh):
      return kda(*xs, initial_state=h0, segment_ids=seg)[0]

  np.testing.assert_allclose(np.asarray(run(*args)), np.asarray(want), rtol=1e-4, atol=1e-4)
  assert "all_gather" in str(jax.make_jaxpr(run)(*args))


def test_unknown_per_shard_mode_is_refused():
  with pytest.raises(ValueError, match="per_shard"):
    catalog().register("linear_attention.gla", "other", gla_chunked, per_shard="columns")

"""meshes.per_shard: kernels XLA cannot partition run per device on their batch rows."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from hylora.core.config import MeshConfig
from hylora.ops import catalog
from meshes.mesh import build_mesh
from meshes.per_shard import (sequence_split, split_over_batch, split_rows_whole_weight,
                              tokens_in_device_order)
from meshes.rules import activation_mesh


@pytest.fixture(scope="module")
def mesh():
  return build_mesh(MeshConfig(fsdp=2, expert=4))


def _rows(mesh, x):
  return jax.device_put(x, NamedSharding(mesh, P(("fsdp", "expert"))))


def test_each_device_sees_its_rows_and_the_result_is_unchanged(mesh):
  seen = []

  def kernel(x, y, *, scale, extra=None):
    seen.append((x.shape, y.shape, scale, extra))
    return x * scale + y.sum(-1, keepdims=True), None

  x = np.random.default_rng(0).normal(size=(8, 4, 3)).astype(np.float32)
  y = np.random.default_rng(1).normal(size=(8, 4, 5)).astype(np.float32)
  wrapped = split_over_batch(kernel)

  @jax.jit
  def run(x, y):
    with activation_mesh(mesh):
      return wrapped(x, y, scale=2.0)

  out, none = run(_rows(mesh, x), _rows(mesh, y))
  assert seen == [((1, 4, 3), (1, 4, 5), 2.0, None)]
  assert none is None
  np.testing.assert_allclose(np.asarray(out), x * 2.0 + y.sum(-1, keepdims=True), rtol=1e-6)


def _with_mesh(mesh, fn, *args, **kwargs):
  with activation_mesh(mesh):
    return fn(*args, **kwargs)


def test_a_weight_arrives_whole_even_when_its_first_dimension_is_the_batch(mesh):
  """8 rows and a weight [8, 3]: split_over_batch would split both; the weight must not."""
  seen = []

  def kernel(x, w, segment_ids, *, shift):
    seen.append((x.shape, w.shape, segment_ids.shape, shift))
    return x * w.sum(0) + segment_ids[..., None] + shift

  rng = np.random.default_rng(2)
  x = rng.normal(size=(8, 4, 3)).astype(np.float32)
  w = rng.normal(size=(8, 3)).astype(np.float32)
  seg = rng.integers(0, 3, size=(8, 4)).astype(np.int32)
  wrapped = split_rows_whole_weight(kernel)

  @jax.jit
  def run(x, w, seg):
    with activation_mesh(mesh):
      return wrapped(x, w, seg, shift=1.0)

  out = run(_rows(mesh, x), w, _rows(mesh, seg))
  assert seen == [((1, 4, 3), (8, 3), (1, 4), 1.0)]
  np.testing.assert_allclose(np.asarray(out), x * w.sum(0) + seg[..., None] + 1.0, rtol=1e-6)
  # without segment ids the kernel gets None on every device
  no_ids = split_rows_whole_weight(
      lambda x, w, segment_ids, *, shift: seen.append(segment_ids) or x * w.sum(0) + shift)
  seen.clear()
  out = jax.jit(lambda x, w: _with_mesh(mesh, no_ids, x, w, None, shift=0.0))(_rows(mesh, x), w)
  np.testing.assert_allclose(np.asarray(out), x * w.sum(0), rtol=1e-6)
  assert seen == [None]


def test_without_a_mesh_or_with_the_sequence_split_the_kernel_sees_everything(mesh):
  seen = []
  kernel = lambda x: seen.append(x.shape) or x + 1
  wrapped = split_over_batch(kernel)
  x = jnp.ones((4, 16, 3))
  wrapped(x)  # no mesh
  with activation_mesh(mesh), warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    # 4 sequences on 2 x 4 devices: the batch takes `expert`, the sequence `fsdp`
    jax.jit(wrapped)(x)
  assert seen == [(4, 16, 3), (4, 16, 3)]
  assert any("split the sequence" in str(w.message) for w in caught)


def test_registered_pallas_gla_runs_per_shard_and_matches_one_device(mesh):
  gla = catalog().resolve("linear_attention.gla", "pallas")  # interpreted on CPU
  keys = jax.random.split(jax.random.key(0), 4)
  shape = (8, 32, 2, 16)
  q, k, v = (jax.random.normal(key, shape, jnp.float32) for key in keys[:3])
  g = jax.nn.log_sigmoid(jax.random.normal(keys[3], shape, jnp.float32))
  want, _ = gla(q, k, v, g)  # outside a mesh: the whole batch at once

  @jax.jit
  def run(q, k, v, g):
    with activation_mesh(mesh):
      return gla(q, k, v, g)[0]

  got = run(*(_rows(mesh, a) for a in (q, k, v, g)))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert "shard_map" in str(jax.make_jaxpr(run)(q, k, v, g))


@pytest.mark.parametrize("batch", [8, 4])  # batch over both axes; batch and sequence split
def test_router_top_k_runs_on_each_devices_tokens(mesh, batch):
  # XLA:CPU partitions its TopK by gathering the whole batch's scores onto every device;
  # the router's selection must stay on each device's tokens (batch, sequence or both).
  from hylora.model.ffn.router import _top_k_experts
  seq, experts, k = 16, 32, 4
  scores = np.random.default_rng(2).normal(size=(batch * seq, experts)).astype(np.float32)
  spec = P(("fsdp", "expert")) if batch == 8 else P(("expert", "fsdp"))
  flat = jax.device_put(scores, NamedSharding(mesh, spec))

  def select(s):
    with activation_mesh(mesh):
      return _top_k_experts(s, k, seq)

  compiled = jax.jit(select).lower(flat).compile().as_text()
  assert "all-gather" not in compiled, "the top-K gathered the batch"
  got = np.asarray(jax.jit(select)(flat))
  want = np.asarray(jax.lax.top_k(scores, k)[1])
  np.testing.assert_array_equal(got, want)


def test_tokens_flatten_in_place_when_batch_and_sequence_share_the_devices():
  """4 rows on fsdp=4 x expert=2: 2 rows a device, the sequence over fsdp. The row-major
  flattening would gather whole rows; tokens_in_device_order keeps every device's tokens
  its own, a permutation of the row-major order."""
  mesh = build_mesh(MeshConfig(fsdp=4, expert=2))
  x = jnp.arange(4 * 64 * 3, dtype=jnp.float32).reshape(4, 64, 3)
  with activation_mesh(mesh):
    _, rows, seq = sequence_split(x)
  assert (rows, seq) == ("expert", "fsdp")
  placed = jax.device_put(x, NamedSharding(mesh, P(rows, seq)))

  def flat(x):
    with activation_mesh(mesh):
      return tokens_in_device_order(x) * 2.0

  compiled = jax.jit(flat).lower(placed).compile()
  assert "all-gather" not in compiled.as_text() and "all-to-all" not in compiled.as_text()
  got = np.asarray(compiled(placed))
  assert got.shape == (256, 3)
  np.testing.assert_array_equal(np.sort(got[:, 0]), np.sort(2 * np.asarray(x)[..., 0].ravel()))
  np.testing.assert_array_equal(got[:, 1] - got[:, 0], 2.0)  # whole tokens moved together

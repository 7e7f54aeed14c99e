"""meshes.gathered_keys: the sparse-attention kernels and their indexer on a sequence
split across devices (over one mesh axis or both, documents crossing the devices'
boundaries) equal the whole sequence; the balanced query order evens out the indexer's
work and selects the same keys; the per-device path at a 1M-token sequence's shapes
builds nothing of [T_local, T_global] beyond the indexer's bounded chunks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from hylora.core.config import MeshConfig
from hylora.ops import catalog
from meshes import gathered_keys
from meshes.mesh import build_mesh
from meshes.per_shard import sequence_split
from meshes.rules import activation_mesh
from pallas_kernels.sparse_attention import (sparse_attention, sparse_attention_reference,
                                             topk_indices, topk_indices_reference)
from pallas_kernels.sparse_attention.indexer_topk import CHUNK_SCORE_BYTES

TOKENS = 8 * 32
TOP_K = 8
DOCUMENT_STARTS = (20, 101, 231)  # documents crossing the boundaries at 32, 64, 96, ...


def _one_axis_mesh():
  return jax.sharding.Mesh(np.asarray(jax.devices()[:8]), ("fsdp",))


MESHES = {
    "8 on one axis": _one_axis_mesh,
    "2 x 4": lambda: build_mesh(MeshConfig(fsdp=2, expert=4))
}


def _inputs(t=TOKENS, seed=0, batch=1):
  keys = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(keys[0], (batch, t, 4, 16), jnp.float32)
  k, v = (jax.random.normal(key, (batch, t, 2, 16), jnp.float32) for key in keys[1:3])
  q_idx = jax.random.normal(keys[3], (batch, t, 2, 16), jnp.float32)
  k_idx = jax.random.normal(keys[4], (batch, t, 16), jnp.float32)
  w = jax.random.uniform(keys[5], (batch, t, 2), jnp.float32)
  documents = np.searchsorted(DOCUMENT_STARTS, np.arange(t), side="right")
  seg = np.stack([documents, documents[::-1]][:batch])  # a second row's documents elsewhere
  return (q, k, v), (q_idx, k_idx, w), jnp.asarray(seg, jnp.int32)


def _close(got, want, name):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  err = np.max(np.abs(got - want)) / np.max(np.abs(want))
  assert err <= 1e-5, f"{name}: relative error {err:.2e}"


def _ops(indexer, attend):
  """The registered implementations by name; "reference": the references run per device as
  the kernels are (what a CPU compile of a GPU step runs in their place)."""
  by_name = lambda name: "reference_per_device" if name == "reference" else name
  return (catalog().resolve("sparse_attention.topk_indices",
                            by_name(indexer)), catalog().resolve("sparse_attention.attend",
                                                                 by_name(attend)))


@pytest.mark.parametrize(
    "mesh_name, indexer, attend, batch",
    [
        ("8 on one axis", "pallas", "pallas", 1),
        ("2 x 4", "pallas", "pallas", 1),
        ("2 x 4", "pallas", "masked_dense", 1),
        ("8 on one axis", "pallas", "by_density", 1),
        ("8 on one axis", "reference", "reference", 1),
        ("2 x 4", "reference", "reference", 1),
        ("2 x 4", "reference", "reference", 2),  # the batch over fsdp, the sequence over expert
    ])
def test_split_sequence_matches_the_whole_sequence(mesh_name, indexer, attend, batch):
  topk, attention = _ops(indexer, attend)
  mesh = MESHES[mesh_name]()
  (q, k, v), indexer_inputs, seg = _inputs(batch=batch)
  probe = jax.random.normal(jax.random.key(7), q.shape)

  def layer(q, k, v):
    idx = topk(*indexer_inputs, top_k=TOP_K, segment_ids=seg)
    o = attention(q, k, v, idx)
    return jnp.sum(o * probe), (idx, o)

  grad = jax.grad(layer, (0, 1, 2), has_aux=True)
  want_grads, (want_idx, want_o) = jax.jit(grad)(q, k, v)

  def split(q, k, v):
    with activation_mesh(mesh):
      _, rows, seq = sequence_split(q)
      assert seq is not None and (rows is None) == (batch == 1)
      return grad(q, k, v)

  jaxpr = str(jax.make_jaxpr(split)(q, k, v))
  # keys gathered, their gradients reduce-scattered back, the indexer's halves exchanged
  for collective in ("all_gather", "reduce_scatter", "ppermute"):
    assert collective in jaxpr, collective
  grads, (idx, o) = jax.jit(split)(q, k, v)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
  assert np.any(np.asarray(idx)[0, 200:] < 192)  # later devices select earlier devices' keys
  _close(o, want_o, "o")
  for name, got, want in zip("qkv", grads, want_grads):
    _close(got, want, f"d{name}")


@pytest.mark.parametrize("mesh_name, reference", [("8 on one axis", False), ("2 x 4", False),
                                                  ("2 x 4", True)])
def test_indexer_in_the_devices_own_order_selects_the_same_keys(mesh_name, reference):
  fn = topk_indices_reference if reference else topk_indices
  unbalanced = gathered_keys.gathered_keys(fn, key_args=(1,), key_kwargs=("segment_ids",),
                                           offset_kwarg="query_offset")
  mesh = MESHES[mesh_name]()
  _, indexer_inputs, seg = _inputs(seed=3)
  want = jax.jit(lambda *a: fn(*a, top_k=TOP_K, segment_ids=seg))(*indexer_inputs)

  def split(*a):
    with activation_mesh(mesh):
      return unbalanced(*a, top_k=TOP_K, segment_ids=seg)

  assert "ppermute" not in str(jax.make_jaxpr(split)(*indexer_inputs))
  np.testing.assert_array_equal(np.asarray(jax.jit(split)(*indexer_inputs)), np.asarray(want))


def test_balanced_order_evens_out_the_indexer_work():
  # the count against query-by-query sums of the kernel's causal key blocks
  one = lambda first, n, block_k: sum(q // block_k + 1 for q in range(first, first + n))
  for devices, local, block_k in ((3, 10, 4), (5, 34, 16)):
    halves = gathered_keys.balanced_half_blocks(devices)
    assert gathered_keys.indexer_key_blocks(devices, local, block_k, balanced=False) == [
        one(d * local, local, block_k) for d in range(devices)
    ]
    assert gathered_keys.indexer_key_blocks(devices, local, block_k, balanced=True) == [
        sum(one(j * (local // 2), local // 2, block_k) for j in pair) for pair in halves
    ]
  for devices in (3, 8, 128):
    for local in (64, 8192):
      plain = gathered_keys.indexer_key_blocks(devices, local, 32, balanced=False)
      even = gathered_keys.indexer_key_blocks(devices, local, 32, balanced=True)
      assert sum(plain) == sum(even)  # the same work, spread evenly
      assert max(even) == min(even), (devices, local)
      assert max(plain) / np.mean(plain) > 1.3  # the last device: about twice the mean
  plain = gathered_keys.indexer_key_blocks(128, 8192, 128, balanced=False)
  assert 1.95 < max(plain) / np.mean(plain) < 2.0
  # every half-block is scored once, by the device the balanced order names
  for devices in (1, 3, 8):
    blocks = sorted(b for pair in gathered_keys.balanced_half_blocks(devices) for b in pair)
    assert blocks == list(range(2 * devices))
  with pytest.raises(ValueError, match="balanced needs offset_kwarg"):
    gathered_keys.gathered_keys(topk_indices, key_args=(1,), balanced=True)


def _array_shapes(jaxpr):
  """Every array shape in a jaxpr and the jaxprs nested in it (loop bodies, kernels)."""
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      yield tuple(getattr(var.aval, "shape", ())), getattr(var.aval, "dtype", None)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _array_shapes(inner)


@pytest.mark.parametrize("reference", [False, True])
def test_one_devices_share_of_a_million_tokens_builds_no_query_by_key_buffer(reference):
  """Traced (not run) at one device's shapes: 8192 queries, 1M gathered keys."""
  local, total = 8192, 1 << 20
  spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  q_idx, k_idx, w = spec((1, local, 64, 128)), spec((1, total, 128)), spec((1, local, 64),
                                                                           jnp.float32)
  q, kv, idx = spec((1, local, 64, 128)), spec((1, total, 8, 128)), spec((1, local, 2048),
                                                                         jnp.int32)
  indexer = topk_indices_reference if reference else topk_indices
  attend = sparse_attention_reference if reference else sparse_attention

  def layer(q_idx, k_idx, w, q, k, v, idx):
    selected = indexer(q_idx, k_idx, w, top_k=2048, query_offset=total - local)
    loss = lambda q, k, v: jnp.sum(attend(q, k, v, idx).astype(jnp.float32))
    return selected, jax.grad(loss, (0, 1, 2))(q, k, v)

  jaxpr = jax.make_jaxpr(layer)(q_idx, k_idx, w, q, kv, kv, idx).jaxpr
  arrays = [(shape, np.prod(shape) * jnp.dtype(dtype).itemsize)
            for shape, dtype in _array_shapes(jaxpr)
            if dtype is not None and shape]
  # past the indexer's chunk bound only per-key tables of channels (K, V, dK, dV)
  for shape, size in arrays:
    assert size <= CHUNK_SCORE_BYTES or shape[-1] == 128, shape
  scores = [size for shape, size in arrays if shape[-1] >= total]
  assert max(scores) >= 1 << 28  # the indexer's scores of a block of queries


def _equations(jaxpr):
  """Every equation of jaxpr and of its sub-jaxprs."""
  for e in jaxpr.eqns:
    yield e
    for param in e.params.values():
      for sub in (param if isinstance(param, (list, tuple)) else [param]):
        inner = getattr(sub, "jaxpr", None)
        if inner is not None:
          yield from _equations(getattr(inner, "jaxpr", inner))


def test_gathered_bf16_keys_get_their_gradients_summed_in_fp32():
  """A gathered bf16 key's gradient is every device's share summed in fp32 and rounded
  once: a bf16 reduce-scatter would round at every step of its ring (over 128 devices)."""
  from meshes.gathered_keys import gather_sequence
  mesh = MESHES["2 x 4"]()
  axes = ("fsdp", "expert")
  x = jnp.ones((1, 64, 4), jnp.bfloat16)
  weight = jax.random.normal(jax.random.key(0), (1, 64, 4), jnp.bfloat16)

  def total(x):
    gathered = jax.shard_map(lambda x: gather_sequence(x, axes) * weight, mesh=mesh,
                             in_specs=P(None, axes), out_specs=P(None, axes), check_vma=False)
    return jnp.sum(gathered(x).astype(jnp.float32))

  scatters = [
      e for e in _equations(jax.make_jaxpr(jax.grad(total))(x).jaxpr)
      if e.primitive.name == "reduce_scatter"
  ]
  assert scatters and all(v.aval.dtype == jnp.float32 for e in scatters for v in e.invars)
  # each of the 8 devices adds weight to every key's gradient
  np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(total))(x), np.float32),
                             8 * np.asarray(weight, np.float32), rtol=1e-2)

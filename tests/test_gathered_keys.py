"""meshes.gathered_keys: the sparse-attention kernels and their indexer on a sequence
split across devices equal the whole sequence."""

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


def _sparse_inputs(b, t, seed=0):
  keys = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(keys[0], (b, t, 4, 16), jnp.float32)
  k, v = (jax.random.normal(key, (b, t, 2, 16), jnp.float32) for key in keys[1:3])
  q_idx = jax.random.normal(keys[3], (b, t, 2, 16), jnp.float32)
  k_idx = jax.random.normal(keys[4], (b, t, 16), jnp.float32)
  w = jax.random.uniform(keys[5], (b, t, 2), jnp.float32)
  seg = np.ones((b, t), np.int32)
  seg[0, t // 2 + 3:] = 2  # a new document in the second range
  return (q, k, v), (q_idx, k_idx, w), jnp.asarray(seg)


@pytest.mark.parametrize("attend_impl", ["pallas", "masked_dense"])
def test_registered_sparse_kernels_on_a_split_sequence_match_the_whole_sequence(attend_impl):
  topk = catalog().resolve("sparse_attention.topk_indices", "pallas")  # interpreted on CPU
  attend = catalog().resolve("sparse_attention.attend", attend_impl)
  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  (q, k, v), indexer, seg = _sparse_inputs(1, 64)
  probe = jax.random.normal(jax.random.key(7), q.shape)

  def layer(q, k, v):
    idx = topk(*indexer, top_k=8, segment_ids=seg)
    o = attend(q, k, v, idx)
    return jnp.sum(o * probe), (idx, o)

  want_grads, (want_idx, want_o) = jax.jit(jax.grad(layer, (0, 1, 2), has_aux=True))(q, k, v)

  @jax.jit
  def run(q, k, v):
    with activation_mesh(mesh):
      return jax.grad(layer, (0, 1, 2), has_aux=True)(q, k, v)

  grads, (idx, o) = run(q, k, v)
  jaxpr = str(jax.make_jaxpr(run)(q, k, v))
  assert "all_gather" in jaxpr and jaxpr.count("shard_map") >= 2
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
  assert np.any(np.asarray(idx)[0, 40:] >= 32)  # the second range selects its own keys too
  np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), rtol=1e-4, atol=1e-4)
  for name, got, want in zip("qkv", grads, want_grads):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4,
                               err_msg=name)


def test_indexer_with_a_query_offset_selects_for_those_positions():
  from pallas_kernels.sparse_attention import topk_indices
  _, (q_idx, k_idx, w), seg = _sparse_inputs(1, 64, seed=2)
  whole = topk_indices(q_idx, k_idx, w, top_k=8, segment_ids=seg)
  part = topk_indices(q_idx[:, 40:56], k_idx, w[:, 40:56], top_k=8, segment_ids=seg,
                      query_offset=40)
  np.testing.assert_array_equal(np.asarray(part), np.asarray(whole[:, 40:56]))
  with pytest.raises(ValueError, match="k_idx must have shape"):
    topk_indices(q_idx, k_idx[:, :32], w, top_k=8, query_offset=0)

"""Rows past the groups are zeroed inside shard_map when the kernel's output is typed as
invariant over the mesh axes while the group sizes vary (the Mosaic kernel's case in the
expert-parallel MoE): the zeroing loop must not mix the two types in its carry."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.grouped_matmul.grouped_matmul import zero_rows_past_groups


def test_zero_rows_past_groups_under_shard_map_with_an_invariant_output():
  mesh = jax.make_mesh((8,), ("e",))
  values = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)

  def per_device(group_sizes):
    out = jnp.asarray(values)  # a constant: invariant over "e", like a kernel's result
    return zero_rows_past_groups(out, group_sizes)[None]

  sizes = np.stack([[d, d + 1] for d in range(8)]).astype(np.int32)  # 2d + 1 rows kept
  run = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("e"), out_specs=P("e")))
  got = np.asarray(run(jax.device_put(sizes.reshape(-1), NamedSharding(mesh, P("e")))))
  for d in range(8):
    kept = 2 * d + 1
    np.testing.assert_array_equal(got[d, :kept], values[:kept])
    np.testing.assert_array_equal(got[d, kept:], 0.0)

"""hylora.profile.hlo_schedule: the compute scheduled inside asynchronous collectives."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from hylora.profile import hlo_schedule

# The shape of a scheduled GPU module: one all-to-all as a dedicated start/done pair
# around a Mosaic grouped matmul, one as a generic async pair around a cuBLAS fusion, one
# whose done follows its start directly, and a tuple type with an /*index=5*/ marker.
GPU_TEXT = """HloModule jit_run, is_scheduled=true

%a2a_body (p: bf16[8,128]) -> bf16[8,128] {
  %p = bf16[8,128]{1,0} parameter(0)
  ROOT %all-to-all.9 = bf16[8,128]{1,0} all-to-all(%p), channel_id=3, dimensions={0}
}

ENTRY %main (x: bf16[8,128], w: bf16[4,128,128], t: (s32[], s32[], s32[], s32[], s32[], /*index=5*/s32[])) -> bf16[8,128] {
  %x = bf16[8,128]{1,0} parameter(0)
  %w = bf16[4,128,128]{2,1,0} parameter(1)
  %t = (s32[], s32[], s32[], s32[], s32[], /*index=5*/s32[]) parameter(2)
  %all-to-all-start = ((bf16[8,128]{1,0}), bf16[8,128]{1,0}) all-to-all-start(%x), channel_id=1, dimensions={0}
  %gmm = bf16[8,128]{1,0} custom-call(%x, %w), custom_call_target="mosaic_gpu_v2"
  %bitcast.1 = bf16[8,128]{1,0} bitcast(%gmm)
  %all-to-all-done = bf16[8,128]{1,0} all-to-all-done(%all-to-all-start)
  %async-start.2 = ((bf16[8,128]{1,0}), bf16[8,128]{1,0}) async-start(%bitcast.1), calls=%a2a_body
  %gemm_fusion.4 = bf16[8,128]{1,0} fusion(%all-to-all-done), kind=kCustom, calls=%fused_gemm
  %async-done.2 = bf16[8,128]{1,0} async-done(%async-start.2)
  %all-to-all-start.1 = ((bf16[8,128]{1,0}), bf16[8,128]{1,0}) all-to-all-start(%async-done.2), channel_id=2, dimensions={0}
  ROOT %all-to-all-done.1 = bf16[8,128]{1,0} all-to-all-done(%all-to-all-start.1)
}
"""


def test_windows_list_the_compute_inside_each_async_pair():
  windows = hlo_schedule.overlap_windows(GPU_TEXT)  # a2a_body belongs to async-start.2
  assert [(w.collective, w.start, w.asynchronous) for w in windows
         ] == [("all-to-all", "all-to-all-start", True), ("all-to-all", "async-start.2", True),
               ("all-to-all", "all-to-all-start.1", True)]
  assert windows[0].compute == ["gmm (mosaic_gpu_v2)"]  # the bitcast is no compute
  assert windows[0].matmuls == ["gmm (mosaic_gpu_v2)"]
  assert windows[1].compute == ["gemm_fusion.4"] and windows[1].matmuls == ["gemm_fusion.4"]
  assert windows[2].compute == []


def test_summary_counts_asynchronous_collectives_with_matmuls_inside():
  s = hlo_schedule.summary(hlo_schedule.overlap_windows(GPU_TEXT))
  assert s == {
      "collective": "all-to-all",
      "count": 3,
      "asynchronous": 3,
      "with_compute_inside": 2,
      "with_matmul_inside": 2,
      "compute_inside": 2,
      "kernels_inside": {
          "mosaic_gpu_v2": 1
      }
  }


def test_cpu_collectives_are_synchronous():
  mesh = jax.make_mesh((8,), ("e",))
  fn = jax.jit(
      jax.shard_map(lambda x: jax.lax.all_to_all(x @ x.T, "e", 0, 0, tiled=True), mesh=mesh,
                    in_specs=P("e"), out_specs=P("e")))
  x = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("e")))
  windows = hlo_schedule.overlap_windows(fn.lower(x).compile().as_text())
  assert [(w.collective, w.asynchronous) for w in windows] == [("all-to-all", False)]

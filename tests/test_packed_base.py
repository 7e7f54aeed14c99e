"""A frozen base kept packed (hylora.quant): which kernels a format packs, how the packed
arrays are sharded and planned, and how a packed linear runs per device. Loading packed
checkpoints and training on them like their bf16 twins: test_quantized_training.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from hylora.core.config import MeshConfig, QuantizationConfig
from hylora.core.errors import ConfigError
from hylora.quant import PackedWeight, is_packed
from hylora.plan.base_storage import base_storage
from hylora.plan.run_plan import resolve
from hylora.train.mesh import run_mesh
from hylora.train import state as st
from meshes.mesh import build_mesh
from meshes.per_shard import split_tokens_whole_weights
from meshes.rules import activation_mesh
from pallas_kernels.quantized_matmul import loop_quantized_matmul, quantized_matmul_reference
from tests.helpers import small_config, two_layer_config

# Routed experts packed, everything else kept in bf16 (as Kimi K3 ships): the house
# family's names for the attention and the dense and shared MLPs.
SPLIT = "model.layers.4.self_attn.q_proj"  # scanned together with layer 8's
EXPERTS_ONLY = ("re:.*self_attn.*", "re:.*mlp\\.(gate|up|down)_proj.*", "re:.*shared_experts.*")


def _packed(fmt: str, ignore=(), **moe):
  cfg = two_layer_config()
  m = cfg.model
  return dataclasses.replace(
      cfg, model=dataclasses.replace(m, moe=dataclasses.replace(m.moe, **moe),
                                     quantization=QuantizationConfig(fmt, tuple(ignore))))


def _kinds(cfg) -> set[str]:
  return set(base_storage(cfg).packed_kinds)


def test_the_format_and_its_ignore_list_choose_the_packed_kernels():
  # FP8 packs every linear it is not told to keep (the MLPs' fused gate/up here are too
  # narrow for its 128-row scale blocks: kept)
  assert _kinds(_packed("fp8_block", EXPERTS_ONLY[1:] + ("re:.*experts.*",))) == {"attention"}
  assert _kinds(_packed("mxfp4", EXPERTS_ONLY)) == {"experts"}
  cfg = _packed("mxfp4", EXPERTS_ONLY, dispatch="auto")
  storage = base_storage(cfg)
  assert storage.format == "mxfp4" and storage.nbytes < storage.bf16_nbytes
  # the run's plan names the format and the ops of the packed products
  plan = resolve(cfg, run_mesh(cfg.mesh))
  assert "frozen base: mxfp4 as shipped" in plan.text()
  ops = {o.op: o for o in plan.ops}
  assert "quantized_grouped_matmul" in ops and "quantized_matmul" not in ops
  assert ops["quantized_grouped_matmul"].per_device == "inside ep_alltoall"
  # an ignore list that splits one stacked array is refused, naming both modules
  split = dataclasses.replace(
      small_config().model, layers=12, dense_layers=4,
      quantization=QuantizationConfig("fp8_block",
                                      (SPLIT,) + EXPERTS_ONLY[1:] + ("re:.*experts.*",)))
  with pytest.raises(ConfigError, match="model.quantization.ignore keeps .* in bf16 but packs"):
    st.model_parts(dataclasses.replace(small_config(), model=split))
  # 4-bit formats need the input width in whole groups of 32: the tiny model's gates are
  # narrower, and the error names the kernel
  with pytest.raises(ConfigError, match="model parameter .*groups of 32"):
    st.model_parts(_packed("int4"))


def test_packed_arrays_are_sharded_like_their_kernels_and_scales_follow_the_codes():
  cfg = _packed("mxfp4", EXPERTS_ONLY, dispatch="auto")
  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  parts = st.model_parts(cfg)
  _, frozen = st.abstract_arrays(parts, mesh)
  packed = [w for w in jax.tree.leaves(frozen, is_leaf=is_packed) if is_packed(w)]
  assert packed and all(w.format == "mxfp4" for w in packed)
  for w in packed:
    codes, scales = w.codes.sharding.spec, w.scales.sharding.spec
    assert codes[1] == "expert"  # the expert slots, as for the bf16 kernel
    # scales take the codes' axes wherever those divide them, else stay whole
    assert all(s in (c, None) for c, s in zip(codes, scales))
    assert w.codes.dtype == jnp.uint8 and w.scales.dtype == jnp.uint8


def test_packed_linear_runs_per_device_on_its_tokens_with_the_weight_whole():
  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  w = PackedWeight.from_kernel(jax.random.normal(jax.random.key(0), (64, 48)), "fp8_block", 1, 0)
  x = jax.random.normal(jax.random.key(1), (8, 16, 64), jnp.bfloat16)
  x = jax.device_put(x, NamedSharding(mesh, P(("fsdp", "expert"))))
  codes = jax.device_put(w.codes, NamedSharding(mesh, P("fsdp")))  # sharded, as FSDP keeps it
  per_device = split_tokens_whole_weights(loop_quantized_matmul)
  with activation_mesh(mesh):
    y = jax.jit(lambda x, c, s: per_device(x, c, s, fmt="fp8_block"))(x, codes, w.scales)
  assert y.sharding.spec[0] == ("fsdp", "expert")
  want = quantized_matmul_reference(x, w.codes, w.scales, fmt="fp8_block")
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32), rtol=2e-2,
                             atol=2e-2)

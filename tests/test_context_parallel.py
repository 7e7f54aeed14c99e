"""Context parallelism: one sequence split over every device trains exactly as on one device.

For each layer kind (the house hybrid's gated linear attention and top-K sparse attention,
Kimi K3's KDA, gated MLA and latent experts, DeepSeek-V3.2's MLA with its indexer), a
batch of one row whose documents cross device boundaries gives the same loss and the same
gradient of every LoRA factor whether the row lies whole on one device or is split over
all 8 devices (one mesh axis, or both axes of 2 x 4). fp32 weights; the
interpreted Pallas kernels or the references run per device as the kernels are.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (fixture_config, loss_and_lora_grads, released_config, small_config,
                     tiny_k3_config)
from hylora.core.config import KernelConfig, MeshConfig
from hylora.io.hf_weights import flat_paths
from hylora.model import IGNORE_INDEX
from hylora.train import state as st
from meshes.mesh import build_mesh
from meshes.per_shard import sequence_axes, sequence_split
from meshes.rules import activation_mesh

T = 512  # 8 devices x 64 tokens
# Documents end at 100 (inside the second device's range), 192 (exactly at the boundary of
# the third and fourth devices) and 300; the last spans three devices.
DOCUMENT_ENDS = (100, 192, 300, T)
# The interpreted Pallas kernels, or the plain-JAX references run per device as the kernels
# are (the same sequence-split wrappers; the kernels' own split tests:
# tests/test_split_recurrence.py, tests/test_gathered_keys.py).
KERNELS = {
    name: KernelConfig(linear_attention=name, topk_indices=name, sparse_attention=name)
    for name in ("pallas", "reference_per_device")
}
# K3's KDA prologue as the Pallas kernel (the default on GPU), each device's range taking
# the previous range's last tokens (meshes/split_conv.py), the rest as references per device
KERNELS["pallas_short_conv"] = KernelConfig(linear_attention="reference_per_device",
                                            topk_indices="reference_per_device",
                                            sparse_attention="reference_per_device",
                                            short_conv="pallas")


def _hybrid():
  cfg = small_config()
  return dataclasses.replace(
      cfg, model=dataclasses.replace(cfg.model, pattern=("linear", "sparse"), layers=2,
                                     dense_layers=1))


def _k3_three_layers():
  """The tiny K3 cut to KDA, KDA, gated MLA (one attention-residual block and a half)."""
  return released_config(tiny_k3_config(layers=3))


# Kimi Linear's KDA and MLA are K3's without its decay bound, output gate and latent
# experts; its MLA alone on a split sequence: tests/test_mla_split.py.
CASES = {
    "hybrid": _hybrid,
    "kimi_k3": _k3_three_layers,
    "deepseek_v32": lambda: released_config(fixture_config("deepseek_v32")),
}


def _config(case: str, dispatch: str, kernels: str):
  cfg = CASES[case]()
  model = dataclasses.replace(cfg.model, weight_dtype="float32",
                              moe=dataclasses.replace(cfg.model.moe, dispatch=dispatch))
  train = dataclasses.replace(cfg.train, batch_size=1, seq_len=T)
  return dataclasses.replace(cfg, model=model, train=train, kernels=KERNELS[kernels])


def _batch(vocab: int) -> dict:
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, vocab, (1, T)).astype(np.int32)
  labels = np.roll(tokens, -1, axis=1)
  segment_ids = np.zeros((1, T), np.int32)
  positions = np.zeros((1, T), np.int32)
  start = 0
  for doc, end in enumerate(DOCUMENT_ENDS):
    segment_ids[0, start:end] = doc + 1
    positions[0, start:end] = np.arange(end - start)
    labels[0, end - 1] = IGNORE_INDEX  # no label across a document's end
    start = end
  return dict(tokens=tokens, labels=labels, segment_ids=segment_ids, positions=positions)


def _adapters_with_signal(lora: dict) -> dict:
  """Every LoRA factor random (B factors start at zero: their A factors would get no
  gradient); drawn on the host, with no compile per factor shape."""
  rng = np.random.default_rng(5)
  return jax.tree.map(lambda x: (0.05 * rng.standard_normal(x.shape)).astype(np.float32), lora)


# The hybrid's kernels over both axes of 2 x 4: tests/test_split_recurrence.py and
# tests/test_gathered_keys.py.
@pytest.mark.parametrize("case, mesh_shape, dispatch, kernels", [
    ("hybrid", (1, 8), "dropless", "pallas"),
    ("kimi_k3", (2, 4), "auto", "pallas_short_conv"),
    ("deepseek_v32", (1, 8), "dropless", "reference_per_device"),
])
def test_a_sequence_split_over_every_device_trains_as_on_one(case, mesh_shape, dispatch, kernels):
  cfg = _config(case, dispatch, kernels)
  mesh = build_mesh(MeshConfig(fsdp=mesh_shape[0], expert=mesh_shape[1]))
  batch = _batch(cfg.model.vocab_size)
  with activation_mesh(mesh):
    split = sequence_split(jnp.zeros((1, T, 1)))
  # the one row split along its length over all 8 devices
  assert split is not None and math.prod(mesh.shape[a] for a in sequence_axes(split[2])) == 8
  lora, frozen = jax.device_get(st.init_params(cfg, st.model_parts(cfg), mesh))
  lora = _adapters_with_signal(lora)

  whole_loss, whole_grads = loss_and_lora_grads(cfg, None, lora, frozen, batch)
  loss, grads = loss_and_lora_grads(cfg, mesh, lora, frozen, batch)

  assert np.isfinite(whole_loss)
  assert abs(loss - whole_loss) <= 1e-5 * abs(whole_loss), (loss, whole_loss)
  want, got = flat_paths(whole_grads), flat_paths(grads)
  assert set(got) == set(want)
  for path in want:
    scale = float(np.max(np.abs(want[path])))
    assert scale > 0, f"{path}: no gradient reaches this adapter"
    np.testing.assert_allclose(got[path] / scale, want[path] / scale, atol=1e-5, rtol=0,
                               err_msg=path)


def test_image_tokens_land_at_their_positions_on_a_split_sequence():
  """The vision tower's tokens replace the embeddings at their global positions, each
  device writing those in its own range: no device gathers the sequence."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  from hylora.model.vision.placement import place_image_tokens
  from meshes import logical_axes as ax
  from meshes.rules import constrain

  mesh = build_mesh(MeshConfig(fsdp=2, expert=4))
  keys = jax.random.split(jax.random.key(2), 2)
  x = jax.random.normal(keys[0], (1, T, 16), jnp.float32)
  tokens = jax.random.normal(keys[1], (1, 2, 24, 16), jnp.float32)
  # two tiles: one inside a device's range, one across the boundary at 192; unused slots -1
  positions = np.concatenate([np.arange(10, 34), np.arange(180, 204)]).reshape(1, 2, 24)
  positions[0, 1, -4:] = -1
  positions = jnp.asarray(positions, jnp.int32)

  def place(x, tokens, positions):
    with activation_mesh(mesh):
      return constrain(place_image_tokens(x, tokens, positions), (ax.BATCH, ax.SEQ, ax.EMBED))

  split_x = jax.device_put(x, NamedSharding(mesh, P(None, ("fsdp", "expert"))))
  compiled = jax.jit(place).lower(split_x, tokens, positions).compile()
  assert "all-gather" not in compiled.as_text()
  np.testing.assert_array_equal(compiled(split_x, tokens, positions),
                                place_image_tokens(x, tokens, positions))

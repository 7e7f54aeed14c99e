"""The image path: placement at placeholder positions, causal and document masks seen
through images, frozen-by-default encoder, LoRA by option, FSDP sharding, 2p8t size."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from hylora.core.errors import DataError
from hylora.model import ForwardContext, HybridLM, LoRAParam
from hylora.model.init import ParamInit
from hylora.model.vision import VisionTower, place_image_tokens
from hylora.core.presets import get_preset
from meshes.mesh import build_mesh
from meshes.rules import state_shardings
from tests.helpers import small_config, small_model

T, IMAGE_AT, DOC2_AT = 64, 10, 30  # row 0: doc 1 = [0, 30) holds a tile at 10..13, doc 2 = [30, 64)


def test_placement_replaces_exactly_the_listed_positions():
  x = jnp.arange(2 * 8 * 3, dtype=jnp.float32).reshape(2, 8, 3)
  tokens = -jnp.arange(1, 2 * 2 * 2 * 3 + 1, dtype=jnp.float32).reshape(2, 2, 2, 3)
  positions = jnp.array([[[1, 2], [6, 7]], [[-1, -1], [0, 5]]])
  out = np.asarray(place_image_tokens(x, tokens, positions))
  want = np.asarray(x).copy()
  want[0, [1, 2, 6, 7]] = np.asarray(tokens[0]).reshape(4, 3)
  want[1, [0, 5]] = np.asarray(tokens[1, 1])
  np.testing.assert_array_equal(out, want)


@pytest.fixture(scope="module")
def model_and_logits():
  cfg = small_config()
  model = small_model()
  graphdef, state = nnx.split(model)
  seg = np.ones((2, T), np.int32)
  seg[:, DOC2_AT:] = 2
  pos = np.concatenate([np.arange(DOC2_AT), np.arange(T - DOC2_AT)])[None].repeat(2, 0)
  ctx = ForwardContext(jnp.asarray(seg), jnp.asarray(pos))
  tokens = jax.random.randint(jax.random.key(1), (2, T), 0, cfg.model.vocab_size)
  n = cfg.model.vision.tokens_per_tile
  positions = np.full((2, 1, n), -1, np.int32)  # one tile slot per row; row 1 has no image
  positions[0, 0] = IMAGE_AT + np.arange(n)
  logits = jax.jit(
      lambda st, im: nnx.merge(graphdef, st).logits(tokens, ctx, im, jnp.asarray(positions)))
  return cfg, model, lambda images: np.asarray(logits(state, images))


def _image(seed, cfg):
  s = cfg.model.vision.image_size
  return jnp.asarray(np.random.default_rng(seed).integers(0, 256, (2, 1, s, s, 3), np.uint8))


def test_an_image_changes_exactly_the_outputs_that_can_see_it(model_and_logits):
  cfg, _, logits = model_and_logits
  a, b = logits(_image(0, cfg)), logits(_image(1, cfg))
  assert np.isfinite(a).all() and np.isfinite(b).all()
  changed = np.abs(a - b).max(axis=-1) > 0  # [2, T]
  sees = np.zeros((2, T), bool)
  sees[0, IMAGE_AT:DOC2_AT] = True  # after the image (causal), inside its document
  np.testing.assert_array_equal(changed, sees)


def test_wrong_image_shapes_are_named(model_and_logits):
  cfg, model, _ = model_and_logits
  ctx = ForwardContext(jnp.ones((1, T), jnp.int32), jnp.arange(T)[None])
  tokens = jnp.zeros((1, T), jnp.int32)
  with pytest.raises(DataError, match=r"batch\['image_positions'\]"):
    model.hidden(tokens, ctx, _image(0, cfg)[:1], jnp.zeros((1, 1, 3), jnp.int32))
  with pytest.raises(DataError, match=r"batch\['images'\]"):
    model.hidden(tokens, ctx, jnp.zeros((1, 1, 8, 8, 3), jnp.uint8), jnp.zeros((1, 1, 4),
                                                                               jnp.int32))


def _with_targets(cfg, targets):
  return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, targets=targets))


def _tower(cfg, init):
  return VisionTower(cfg.model, cfg.lora, init=init)


def test_encoder_frozen_by_default_and_adapted_by_option():
  cfg = small_config()  # default targets: the LM's q, k, v, o, gate_up
  default = nnx.eval_shape(lambda: _tower(cfg, init=ParamInit(0)))
  assert not jax.tree.leaves(nnx.state(default, LoRAParam))
  assert jax.tree.leaves(nnx.state(default, nnx.Param))
  opted = nnx.eval_shape(lambda: _tower(_with_targets(cfg, cfg.lora.targets +
                                                      ("vision.*",)), init=ParamInit(0)))
  adapted = {str(path[-2]) for path, _ in nnx.to_flat_state(nnx.state(opted, LoRAParam))}
  assert adapted == {"q", "k", "v", "o", "fc1", "fc2", "patch_embed", "proj_in", "proj_out"}
  only_attention = nnx.eval_shape(
      lambda: _tower(_with_targets(cfg, ("vision.q", "vision.v")), init=ParamInit(0)))
  adapted = {str(path[-2]) for path, _ in nnx.to_flat_state(nnx.state(only_attention, LoRAParam))}
  assert adapted == {"q", "v"}


def test_vision_weights_are_fsdp_sharded():
  cfg = small_config()
  tower = nnx.eval_shape(lambda: _tower(cfg, init=ParamInit(0)))
  vision = nnx.to_pure_dict(state_shardings(nnx.state(tower), build_mesh(cfg.mesh)))
  assert vision["encoder"]["blocks"]["fc1"]["kernel"].spec == P(None, ("fsdp", "expert"), None)
  assert vision["encoder"]["blocks"]["q"]["kernel"].spec == P(None, ("fsdp", "expert"), None, None)
  assert vision["projector"]["proj_out"]["kernel"].spec == P(("fsdp", "expert"), None)


def test_enabling_vision_leaves_the_language_model_weights_unchanged():
  cfg = small_config()
  off = dataclasses.replace(
      cfg, model=dataclasses.replace(cfg.model,
                                     vision=dataclasses.replace(cfg.model.vision, enabled=False)))

  @functools.partial(jax.jit, static_argnums=0)
  def first_and_last_lm_weights(with_vision):
    chosen = cfg if with_vision else off
    model = HybridLM(chosen.model, chosen.lora, init=ParamInit(3))
    return model.embed[...], model.lm_head[...]  # the LM's first and last draws

  for a, b in zip(first_and_last_lm_weights(True), first_and_last_lm_weights(False)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_2p8t_encoder_is_about_0p4b():
  tower = nnx.eval_shape(lambda: _tower(get_preset("2p8t"), init=ParamInit(0)))
  count = sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(tower)))
  assert 0.35e9 < count < 0.45e9

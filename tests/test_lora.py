"""LoRA: the adapted model starts as the base model; only adapters train."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hylora.model import ForwardContext, HybridLM, LoRAParam
from hylora.model.init import ParamInit
from tests.helpers import small_config, small_model


def _ctx(b, t):
  seg = jnp.concatenate(
      [jnp.ones((b, t // 2), jnp.int32), 2 * jnp.ones((b, t - t // 2), jnp.int32)], 1)
  pos = jnp.concatenate([jnp.arange(t // 2), jnp.arange(t - t // 2)])[None].repeat(b, 0)
  return ForwardContext(seg, pos)


@pytest.fixture(scope="module")
def adapted():
  """HybridLM(small_config().model, small_config().lora, init=ParamInit(0)): the model with its initial adapters."""
  return small_model()


def test_step0_adapted_model_reproduces_the_base_model_exactly(adapted):
  cfg = small_config()
  base_cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, targets=()))
  base = nnx.eval_shape(lambda: HybridLM(base_cfg.model, base_cfg.lora, init=ParamInit(0)))
  assert not jax.tree.leaves(nnx.state(base, LoRAParam))
  nnx.update(base, nnx.state(adapted, nnx.Not(LoRAParam)))
  tokens = jax.random.randint(jax.random.key(0), (2, 64), 0, cfg.model.vocab_size)
  logits = jax.jit(lambda m, t: m.logits(t, _ctx(2, 64)))
  a, b = logits(adapted, tokens), logits(base, tokens)
  assert np.isfinite(np.asarray(a)).all()
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_adapters_are_fp32_base_is_bf16_and_b_starts_at_zero(adapted):
  model = nnx.eval_shape(lambda: HybridLM(small_config().model,
                                          small_config().lora, init=ParamInit(0)))
  lora = nnx.to_flat_state(nnx.state(model, LoRAParam))
  frozen = nnx.to_flat_state(nnx.state(model, nnx.Not(LoRAParam)))
  assert lora and all(v.dtype == jnp.float32 for _, v in lora)
  weights = ("kernel", "gate_up", "down", "embed", "lm_head")
  big = [v for path, v in frozen if path[-1] in weights]
  assert big and all(v.dtype == jnp.bfloat16 for v in big)
  targets = {str(path[-2]) for path, _ in lora}
  assert targets == {"q", "k", "v", "o", "gate_up", "experts"}
  for path, v in nnx.to_flat_state(nnx.state(adapted, LoRAParam)):
    if path[-1] == "lora_b":
      assert not np.asarray(v[...]).any()

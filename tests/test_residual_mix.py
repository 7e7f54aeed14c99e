"""The worked example of docs/day_one.md: the depth-mix residual, one registered op
("residual_mix") used by a residual scheme chosen by `model.residual`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hylora.core.config import Config
from hylora.core.errors import ConfigError
from hylora.model import Execution, HybridLM, LoRAParam
from hylora.model.init import ParamInit
from hylora.model.residual import DepthMixResidual
from hylora.data.sources import Packer, make_source
from pallas_kernels.residual_mix import residual_mix, residual_mix_reference
from tests.helpers import small_config

# compile time dominates; cheap XLA:CPU codegen
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _cfg(residual: str) -> Config:
  cfg = small_config()
  model = dataclasses.replace(cfg.model, layers=3, pattern=("linear", "sparse"), dense_layers=3,
                              residual=residual, residual_window=2)
  return dataclasses.replace(cfg, model=model).validate()


@pytest.fixture(scope="module")
def batch():
  cfg = _cfg("add")
  packer = Packer(make_source("synthetic", cfg.model.vocab_size, 0, (16, 48)), 64)
  return {k: jnp.asarray(v) for k, v in packer.next_batch(2).items()}


def _loss_fn(cfg, batch):
  """jitted (mix weights [W + 1] for every layer) -> (loss, its gradient); the model is
  built inside."""

  def loss(weights):
    model = HybridLM(cfg.model, cfg.lora, init=ParamInit(0))
    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)
    lora = jax.tree.map_with_path(
        lambda p, x: jnp.broadcast_to(weights, x.shape) if "residual" in str(p) else x, lora)
    loss_sum, count, _ = nnx.merge(graphdef, lora,
                                   rest).loss_terms(batch,
                                                    execution=Execution(cfg.kernels, cfg.memory))
    return loss_sum / count

  return jax.jit(jax.value_and_grad(loss), compiler_options=FAST_COMPILE)


def test_depth_mix_starts_as_the_plain_residual_and_its_weights_learn(batch):
  identity = jnp.array([1.0, 0.0, 0.0])
  add_loss = float(_loss_fn(_cfg("add"), batch)(identity)[0])
  mix = _loss_fn(_cfg("depth_mix"), batch)
  mix_loss, grad = mix(identity)
  # The same model: only XLA's fusion (bf16 kept in fp32 across fused ops) differs.
  assert float(mix_loss) == pytest.approx(add_loss, abs=2e-3)
  assert bool(jnp.all(jnp.isfinite(grad))) and float(jnp.max(jnp.abs(grad[1:]))) > 0
  # Other weights give another model.
  other = float(mix(jnp.array([0.0, 2.0, 1.0]))[0])
  assert abs(other - float(mix_loss)) > 5e-2


def test_history_holds_earlier_outputs_newest_first():
  mod = DepthMixResidual(_cfg("depth_mix").model, init=ParamInit(0))
  x0 = jnp.ones((1, 2, 4), jnp.bfloat16)
  stream = DepthMixResidual.start(_cfg("depth_mix").model, x0)
  stream = mod.update(stream, 2 * x0)  # layer 0: input x0, output 2 x0
  stream = mod.update(stream, 3 * x0)  # layer 1: input 2 x0, output 3 x0
  x, history = stream
  np.testing.assert_array_equal(x, 3 * x0)
  np.testing.assert_array_equal(history, jnp.stack([2 * x0, x0]))


def test_kernel_matches_reference_exactly_at_fp32():
  ks = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(ks[0], (3, 5, 48))  # rows and columns not powers of two
  h = jax.random.normal(ks[1], (3, 3, 5, 48))
  w = jax.random.normal(ks[2], (4,))
  np.testing.assert_allclose(residual_mix(x, h, w), residual_mix_reference(x, h, w), rtol=1e-6,
                             atol=1e-6)


def test_bad_inputs_and_config_are_named():
  x = jnp.zeros((2, 8, 16))
  with pytest.raises(ValueError, match="history must have shape"):
    residual_mix_reference(x, jnp.zeros((2, 2, 8, 15)), jnp.zeros(3))
  with pytest.raises(ValueError, match=r"weights must have shape \[W \+ 1\] = \[3\]"):
    residual_mix(x, jnp.zeros((2, 2, 8, 16)), jnp.zeros(2))
  with pytest.raises(ConfigError, match="model.residual"):
    dataclasses.replace(small_config(), model=dataclasses.replace(small_config().model,
                                                                  residual="dense")).validate()
  with pytest.raises(ConfigError, match="model.residual_window"):
    dataclasses.replace(small_config(), model=dataclasses.replace(small_config().model,
                                                                  residual_window=0)).validate()

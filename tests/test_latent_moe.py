"""The latent MoE (Kimi K3) with SiTU-GLU experts against a numpy reference that loops
densely over the experts, in fp32; the expert-parallel dispatcher carries the activation
through to the experts unchanged."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hylora.core.config import MeshConfig
from hylora.model.context import ForwardContext
from hylora.model.ffn import FFNS
from hylora.model.ffn.activations import Activation, gated
from hylora.model.ffn.latent_moe import LatentMoE
from hylora.model.init import ParamInit
from meshes.mesh import build_mesh
from meshes.rules import activation_mesh
from tests.helpers import small_config

B, T = 2, 32
BETA, LINEAR_BETA = 2.0, 1.0  # small enough that both tanh bounds bend the values


def _config(**moe):
  cfg = small_config()
  moe_cfg = dataclasses.replace(cfg.model.moe, experts=8, top_k=2, expert_ffn=24, shared_experts=1,
                                latent_dim=16, score_fn="sigmoid", normalize_top_k=True,
                                routed_scale=2.0, **moe)
  model = dataclasses.replace(cfg.model, weight_dtype="float32", activation="situ", situ_beta=BETA,
                              situ_linear_beta=LINEAR_BETA, ffn="latent_moe", moe=moe_cfg)
  return dataclasses.replace(cfg, model=model)


def _layer(cfg):

  def build():
    layer = LatentMoE(cfg.model, cfg.lora, init=ParamInit(0))
    init = ParamInit(1)  # trained-looking adapters, bias and norm: all of them matter
    for b in (layer.experts.lora_b, layer.shared.gate_up.lora_b):
      b[...] = init.normal(b.shape, 0.5)
    layer.router.bias[...] = init.normal(layer.router.bias.shape, 0.1)
    scale = layer.routed_expert_norm.scale
    scale[...] = 1.0 + init.normal(scale.shape, 0.3)
    return layer

  return nnx.jit(build)()


def _situ(gate, up):
  up = LINEAR_BETA * np.tanh(up / LINEAR_BETA)
  return BETA * np.tanh(gate / BETA) / (1.0 + np.exp(-gate)) * up


def _numpy_reference(layer, x, cfg):
  """K3's MoE forward, token rows at once, every expert in turn (float64)."""
  moe, f64 = cfg.model.moe, lambda a: np.asarray(a, np.float64)
  scale = cfg.lora.scale
  flat = f64(x).reshape(-1, x.shape[-1])
  scores = 1.0 / (1.0 + np.exp(-flat @ f64(layer.router.kernel[...])))
  top = np.argsort(-(scores + f64(layer.router.bias[...])), axis=1)[:, :moe.top_k]
  w = np.take_along_axis(scores, top, 1)
  w = w / (w.sum(1, keepdims=True) + 1e-20) * moe.routed_scale
  latent = flat @ f64(layer.routed_expert_down_proj.kernel[...])
  acc = np.zeros_like(latent)
  ex = {k: f64(v) for k, v in layer.experts.weights().items()}
  for e in range(moe.experts):
    h = latent @ ex["gate_up"][e] + scale * (latent @ ex["lora_a"][e]) @ ex["lora_b"][e]
    gate, up = np.split(h, 2, axis=-1)
    weight = np.sum(w * (top == e), axis=1, keepdims=True)  # 0 where e was not chosen
    acc += weight * (_situ(gate, up) @ ex["down"][e])
  normed = acc / np.sqrt(np.mean(acc * acc, -1, keepdims=True) + cfg.model.norm_eps)
  routed = (normed * f64(layer.routed_expert_norm.scale[...])) @ f64(
      layer.routed_expert_up_proj.kernel[...])
  sh = layer.shared
  h = flat @ f64(sh.gate_up.kernel[...]) + scale * (flat @ f64(sh.gate_up.lora_a[...])) @ f64(
      sh.gate_up.lora_b[...])
  gate, up = np.split(h, 2, axis=-1)
  return (routed + _situ(gate, up) @ f64(sh.down.kernel[...])).reshape(x.shape)


def _ctx():
  return ForwardContext(jnp.ones((B, T), jnp.int32), jnp.zeros((B, T), jnp.int32))


@pytest.fixture(scope="module")
def case():
  cfg = _config()
  layer = _layer(cfg)
  x = jax.random.normal(jax.random.key(0), (B, T, cfg.model.d_model), jnp.float32)
  return cfg, layer, x


def test_latent_moe_matches_dense_numpy_reference(case):
  cfg, layer, x = case
  assert FFNS["latent_moe"] is LatentMoE
  y, aux = nnx.jit(lambda layer, x: layer(x, _ctx()))(layer, x)
  want = _numpy_reference(layer, np.asarray(x), cfg)
  err = np.abs(np.asarray(y, np.float64) - want).max() / np.abs(want).max()
  assert err < 1e-5, err
  assert float(aux["expert_load"].sum()) == B * T * cfg.model.moe.top_k
  # Shapes as the checkpoint lays them out (transposed): the experts live on the latent.
  latent, d, f = 16, cfg.model.d_model, cfg.model.moe.expert_ffn
  assert layer.experts.gate_up.shape == (8, latent, 2 * f)
  assert layer.experts.down.shape == (8, f, latent)
  assert layer.routed_expert_down_proj.kernel.shape == (d, latent)
  assert layer.routed_expert_up_proj.kernel.shape == (latent, d)
  assert layer.routed_expert_down_proj.lora_a is None  # frozen projections


def test_expert_parallel_dispatch_carries_the_activation(case):
  _, layer, x = case
  ep_cfg = _config(dispatch="ep_alltoall")
  ep_layer = _layer(ep_cfg)
  want = nnx.jit(lambda layer, x: layer(x, _ctx())[0])(layer, x)

  def run(layer, x):
    with activation_mesh(build_mesh(MeshConfig(fsdp=2, expert=4))):
      return layer(x, _ctx())[0]

  np.testing.assert_allclose(nnx.jit(run)(ep_layer, x), want, rtol=1e-5, atol=1e-5)


def test_gated_activations():
  rng = np.random.default_rng(0)
  gate, up = (rng.standard_normal((5, 7)).astype(np.float32) * 3 for _ in range(2))
  cfg = _config().model
  np.testing.assert_allclose(gated(gate, up, cfg), _situ(gate, up), rtol=1e-5, atol=1e-6)
  silu = dataclasses.replace(cfg, activation="silu")
  np.testing.assert_allclose(gated(gate, up, silu), gate / (1 + np.exp(-gate)) * up, rtol=1e-5,
                             atol=1e-6)
  # No linear bound when situ_linear_beta <= 0; bf16 in, bf16 out (computed in fp32).
  unbounded = Activation("situ", BETA, 0.0)
  np.testing.assert_allclose(unbounded(gate, up),
                             BETA * np.tanh(gate / BETA) / (1 + np.exp(-gate)) * up, rtol=1e-5,
                             atol=1e-6)
  assert unbounded(jnp.asarray(gate, jnp.bfloat16),
                   jnp.asarray(up, jnp.bfloat16)).dtype == (jnp.bfloat16)

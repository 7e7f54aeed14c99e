"""The dropless MoE (sort by expert + grouped matmuls) against a per-token loop."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hylora.model.context import ForwardContext
from hylora.model.ffn.moe import MoE
from hylora.model.init import ParamInit
from hylora.model.lora import LoRAParam
from tests.helpers import small_config


def _moe_with_trained_adapters(seed=0):
  cfg = small_config()

  def build():
    moe = MoE(cfg.model, cfg.lora, init=ParamInit(seed))
    # Non-zero B so the adapters change the output and A receives gradients.
    init = ParamInit(seed + 1)
    for b in (moe.experts.lora_b, moe.shared.gate_up.lora_b):
      b[...] = init.normal(b.shape, 0.5)
    return moe

  return cfg, nnx.jit(build)()  # one compile instead of hundreds of eager initialisers


def _loop_reference(moe, x):
  """Each token through each chosen expert, one at a time, weighted and summed."""
  cfg = moe.cfg
  flat = x.reshape(-1, x.shape[-1])
  weights, experts, _ = moe.router(flat)
  w = moe.experts.weights()
  scale = moe.experts.lora_scale

  def one_token(token):
    xn, weights_n, experts_n = token
    xn = xn.astype(jnp.float32)
    acc = jnp.zeros_like(xn)
    for j in range(cfg.top_k):
      e = experts_n[j]
      h = xn @ w["gate_up"][e].astype(jnp.float32)
      h = h + scale * (xn @ w["lora_a"][e]) @ w["lora_b"][e]
      gate, up = jnp.split(h, 2)
      acc = acc + weights_n[j] * ((jax.nn.silu(gate) * up) @ w["down"][e].astype(jnp.float32))
    return acc

  # A loop over the tokens (compiled once, not unrolled).
  y = jax.lax.map(one_token, (flat, weights, experts)).reshape(x.shape)
  return y + moe.shared(x.astype(jnp.float32)).astype(jnp.float32)


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_dropless_moe_matches_per_token_loop_forward_and_gradients():
  cfg, moe = _moe_with_trained_adapters()
  x = jax.random.normal(jax.random.key(0), (2, 12, cfg.model.d_model), jnp.float32)
  ctx = ForwardContext(jnp.ones((2, 12), jnp.int32), jnp.zeros((2, 12), jnp.int32))
  graphdef, lora, rest = nnx.split(moe, LoRAParam, ...)

  def fast(lora, x):
    y, _ = nnx.merge(graphdef, lora, rest)(x.astype(jnp.bfloat16), ctx)
    return y.astype(jnp.float32)

  def slow(lora, x):
    return _loop_reference(nnx.merge(graphdef, lora, rest), x)

  probe = jax.random.normal(jax.random.key(1), x.shape)

  # Each path's output and gradients from one compiled program rather than op by op.
  @jax.jit
  def value_and_grads(lora, x):
    out = {}
    for name, f in (("fast", fast), ("slow", slow)):
      y, pullback = jax.vjp(f, lora, x)
      out[name] = (y, pullback(probe))
    return out

  out = value_and_grads(lora, x)
  (y_fast, g_fast), (y_slow, g_slow) = out["fast"], out["slow"]
  assert _rel(y_fast, y_slow) < 2e-2
  assert _rel(g_fast[1], g_slow[1]) < 3e-2
  for a, b in zip(jax.tree.leaves(g_fast[0]), jax.tree.leaves(g_slow[0])):
    assert np.abs(np.asarray(b)).max() > 0
    assert _rel(a, b) < 3e-2


def test_router_metrics_on_a_hand_built_routing():
  cfg, moe = _moe_with_trained_adapters()
  d, e = cfg.model.d_model, cfg.model.moe.experts
  # Router weights that send token i to experts (i % e) and ((i + 1) % e).
  kernel = np.zeros((d, e), np.float32)
  x = np.zeros((e, d), np.float32)
  for i in range(e):
    x[i, i] = 1.0
    kernel[i, i], kernel[i, (i + 1) % e] = 8.0, 6.0
  moe.router.kernel[...] = jnp.asarray(kernel, jnp.bfloat16)
  weights, experts, aux = moe.router(jnp.asarray(x))
  np.testing.assert_array_equal(np.sort(np.asarray(experts), axis=1),
                                np.sort(np.stack([np.arange(e), (np.arange(e) + 1) % e], 1), 1))
  np.testing.assert_allclose(np.asarray(aux["expert_load"]), np.full(e, 2.0))
  np.testing.assert_allclose(np.asarray(weights).sum(1), 1.0, rtol=1e-6)

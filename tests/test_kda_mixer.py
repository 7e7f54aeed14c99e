"""The Kimi Delta Attention mixer against a plain-numpy reference of the published
definition (Kimi Linear; Kimi K3's bounded decay and full-rank output gate), packed
documents, and LoRA gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hylora.core.config import KDAConfig, KernelConfig, LoRAConfig, MeshConfig, ModelConfig
from hylora.model import ForwardContext, LoRAParam
from hylora.model.init import ParamInit
from hylora.model.mixers import MIXERS
from hylora.model.execution import Execution
from hylora.model.mixers.kda import KimiDeltaAttention
from meshes.mesh import build_mesh
from meshes.rules import activation_mesh

D, H, HD, K = 32, 2, 16, 4
KIMI_LINEAR = KDAConfig(heads=H, head_dim=HD, conv_size=K, gate_rank=8, output_gate_rank=8)
K3 = dataclasses.replace(KIMI_LINEAR, output_gate_rank=0, gate_lower_bound=-5.0)


def _model_config(kda: KDAConfig) -> ModelConfig:
  return ModelConfig(d_model=D, weight_dtype="float32", norm_eps=1e-5, kda=kda)


def _init(kda: KDAConfig, seed: int = 0) -> KimiDeltaAttention:
  """KimiDeltaAttention as initialised, by one compiled program rather than eager ops."""
  build = lambda: KimiDeltaAttention(_model_config(kda), None, init=ParamInit(seed))
  graphdef, _ = nnx.split(nnx.eval_shape(build))
  return nnx.merge(graphdef, jax.jit(lambda: nnx.split(build())[1])())


def _random_value(name: str, shape, rng: np.random.Generator) -> np.ndarray:
  """A fresh random value for each parameter: a strong decay on head 0 (exp(A_log) = 150)
  and a mild one on head 1, a non-trivial norm weight, adapters away from zero."""
  if name == "A_log":
    return np.array([np.log(150.0), 0.3])
  if name == "dt_bias":
    return rng.normal(-1.0, 1.0, shape)
  if name == "o_norm":
    return rng.uniform(0.5, 1.5, shape)
  if name.endswith("_conv"):
    return rng.normal(0.0, 0.5, shape)
  if name.endswith("lora_b"):  # B = 0 would zero A's gradient
    return rng.normal(0.0, 0.1, shape)
  fan_in = np.prod(shape[:2]) if name.startswith("o_proj/") else shape[0]
  return rng.normal(0.0, fan_in**-0.5, shape)


def _mixer(kda: KDAConfig, lora: LoRAConfig | None = None, seed: int = 0) -> KimiDeltaAttention:
  """The module's structure with random parameters drawn in numpy (nothing to compile)."""
  abstract = nnx.eval_shape(
      lambda: KimiDeltaAttention(_model_config(kda), lora, init=ParamInit(seed)))
  graphdef, state = nnx.split(abstract)
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    name = "/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
    return jnp.asarray(_random_value(name, leaf.shape, rng), leaf.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


def _context(segment_ids: np.ndarray) -> ForwardContext:
  seg = jnp.asarray(segment_ids, jnp.int32)
  starts = np.concatenate(
      [np.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
  pos = np.zeros_like(segment_ids)
  for b, t in np.ndindex(segment_ids.shape):
    pos[b, t] = 0 if starts[b, t] else pos[b, t - 1] + 1
  return ForwardContext(seg, jnp.asarray(pos, jnp.int32))


@jax.jit
def _forward(mixer, x, ctx):
  return mixer(x, ctx)[0]


def _params(mixer) -> dict[str, np.ndarray]:
  flat = nnx.to_flat_state(nnx.state(mixer, nnx.Param))
  return {"/".join(map(str, path)): np.asarray(v[...], np.float64) for path, v in flat}


# ---- the numpy reference, float64 ----


def _decay(mixer, x):
  """The layer's log decay g for inputs x, as its op computes it."""
  return mixer.decay_gate()(mixer.f_b_proj(mixer.f_a_proj(x)))


def _sigmoid(z):
  return 0.5 * (1.0 + np.tanh(0.5 * z))  # no overflow for large |z|


def _doc_starts(segment_ids):
  """For every token, the index of the first token of its document (a change of id
  starts a new document)."""
  starts = np.zeros(segment_ids.shape, int)
  for b, t in np.ndindex(segment_ids.shape):
    new = t == 0 or segment_ids[b, t] != segment_ids[b, t - 1]
    starts[b, t] = t if new else starts[b, t - 1]
  return starts


def _reference(p: dict, kda: KDAConfig, eps: float, x: np.ndarray, segment_ids: np.ndarray):
  x = x.astype(np.float64)
  bsz, length, _ = x.shape
  starts = _doc_starts(segment_ids)

  def short_conv(y, w):  # y [B, T, H, hd], w [H, hd, K]: tap K-1 on the current token
    out = np.zeros_like(y)
    for b, t in np.ndindex(bsz, length):
      for s in range(kda.conv_size):
        if t - s >= starts[b, t]:
          out[b, t] += w[..., kda.conv_size - 1 - s] * y[b, t - s]
    return out * _sigmoid(out)  # SiLU

  q, k, v = (short_conv(np.einsum("btd,dhe->bthe", x, p[f"{n}_proj/kernel"]), p[f"{n}_conv"])
             for n in "qkv")
  f = np.einsum("btr,rhe->bthe", x @ p["f_a_proj/kernel"], p["f_b_proj/kernel"]) + p["dt_bias"]
  rate = np.exp(p["A_log"])[:, None]
  if kda.gate_lower_bound < 0:
    g = kda.gate_lower_bound * _sigmoid(rate * f)
  else:
    g = -rate * np.logaddexp(0.0, f)
  beta = _sigmoid(x @ p["b_proj/kernel"])
  if kda.output_gate_rank:
    gate = np.einsum("btr,rhe->bthe", x @ p["g_a_proj/kernel"], p["g_b_proj/kernel"])
  else:
    gate = np.einsum("btd,dhe->bthe", x, p["g_proj/kernel"])

  unit = lambda a: a / np.sqrt(np.sum(a * a) + 1e-6)
  o = np.zeros_like(v)
  for b, h in np.ndindex(bsz, kda.heads):
    state = np.zeros((kda.head_dim, kda.head_dim))
    for t in range(length):
      if starts[b, t] == t:
        state[:] = 0.0
      qt, kt = unit(q[b, t, h]), unit(k[b, t, h])
      bt = beta[b, t, h]
      state = (
          (np.eye(kda.head_dim) - bt * np.outer(kt, kt)) @ (np.exp(g[b, t, h])[:, None] * state) +
          bt * np.outer(kt, v[b, t, h]))
      o[b, t, h] = kda.head_dim**-0.5 * state.T @ qt
  normed = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + eps) * p["o_norm"] * _sigmoid(gate)
  return np.einsum("bthe,hed->btd", normed, p["o_proj/kernel"])


B, T = 4, 80  # one shape for every forward: one compile per configuration


def _check_against_reference(kda: KDAConfig, seed: int):
  mixer = _mixer(kda, seed=seed)
  x = np.random.default_rng(seed + 10).normal(size=(B, T, D)).astype(np.float32)
  seg = np.ones((B, T), np.int32)
  seg[1, 37:] = 2  # two documents, the boundary inside a 64-token chunk
  seg[2, 70:] = 2  # the boundary across a chunk border
  seg[3, 10:], seg[3, 50:] = 2, 1  # three documents, the third reusing the first one's id
  y = np.asarray(_forward(mixer, jnp.asarray(x), _context(seg)))
  ref = _reference(_params(mixer), kda, 1e-5, x, seg)
  # The per-head RMSNorm scales fp32 rounding of small attention outputs up to the output.
  np.testing.assert_allclose(y, ref, atol=2e-5 * np.abs(ref).max(), rtol=0)
  return mixer


def test_kimi_linear_matches_the_numpy_reference_with_strong_and_mild_decays():
  mixer = _check_against_reference(KIMI_LINEAR, seed=0)
  g = np.asarray(_decay(mixer, jnp.ones((1, 1, D), jnp.float32)))
  assert g[..., 0, :].mean() < 5 * g[..., 1, :].mean()  # head 0 really decays harder


def test_k3_bounded_decay_and_full_rank_gate_match_the_numpy_reference():
  mixer = _check_against_reference(K3, seed=1)
  g = np.asarray(_decay(mixer, jnp.asarray(np.random.default_rng(2).normal(size=(1, 8, D)) * 10)))
  assert (g >= K3.gate_lower_bound).all() and (g <= 0).all()


def test_parameter_paths_shapes_and_dtypes():
  p = nnx.to_flat_state(nnx.state(_mixer(KIMI_LINEAR), nnx.Param))
  shapes = {"/".join(map(str, path)): (v.shape, v.dtype) for path, v in p}
  f32 = jnp.float32
  assert shapes == {
      "q_proj/kernel": ((D, H, HD), f32),
      "k_proj/kernel": ((D, H, HD), f32),
      "v_proj/kernel": ((D, H, HD), f32),
      "o_proj/kernel": ((H, HD, D), f32),
      "q_conv": ((H, HD, K), f32),
      "k_conv": ((H, HD, K), f32),
      "v_conv": ((H, HD, K), f32),
      "f_a_proj/kernel": ((D, 8), f32),
      "f_b_proj/kernel": ((8, H, HD), f32),
      "dt_bias": ((H, HD), f32),
      "A_log": ((H,), f32),
      "b_proj/kernel": ((D, H), f32),
      "g_a_proj/kernel": ((D, 8), f32),
      "g_b_proj/kernel": ((8, H, HD), f32),
      "o_norm": ((HD,), f32)
  }
  k3 = {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(_mixer(K3), nnx.Param))}
  assert "g_proj/kernel" in k3 and "g_a_proj/kernel" not in k3
  assert MIXERS["kda"] is KimiDeltaAttention


def test_released_decay_init():
  mixer = _init(KIMI_LINEAR)
  a = np.exp(np.asarray(mixer.A_log[...]))
  dt = np.logaddexp(0.0, np.asarray(mixer.dt_bias[...], np.float64))
  assert ((a >= 1) & (a <= 16)).all()
  assert ((dt > 0.9e-3) & (dt < 1.1e-1)).all()


def test_packed_documents_equal_each_document_alone():
  mixer = _mixer(KIMI_LINEAR, seed=2)
  lengths = (29, 30, 21)  # boundaries inside a 64-token chunk and across one
  docs = np.random.default_rng(3).normal(size=(T, D)).astype(np.float32)
  # Row 0 packs the three documents, the third reusing the first one's id; row i + 1 holds
  # document i alone at the start of the row, zeros after it (causal: they change nothing).
  x = np.zeros((B, T, D), np.float32)
  x[0] = docs
  seg = np.ones((B, T), np.int32)
  seg[0] = np.concatenate([np.full(n, i) for i, n in zip((1, 2, 1), lengths)])
  bounds = np.cumsum((0,) + lengths)
  for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
    x[i + 1, :hi - lo] = docs[lo:hi]
  y = np.asarray(_forward(mixer, jnp.asarray(x), _context(seg)))
  for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
    # Rounding differs with the chunk position; a leak across documents would be O(0.1).
    np.testing.assert_allclose(y[0, lo:hi], y[i + 1, :hi - lo], atol=2e-5, rtol=0)


def test_the_fused_prologue_gives_the_layer_the_reference_path_s_outputs_and_gradients():
  """short_conv="pallas" (interpreted here), each device running it on its rows: the same
  outputs and input gradients as the plain-JAX prologue."""
  mixer = _mixer(K3, seed=4)
  x = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, D)).astype(np.float32))
  seg = np.ones((B, T), np.int32)
  seg[1, 33:], seg[2, 48:] = 2, 3  # a boundary one token after a block, one on a block edge
  mesh = build_mesh(MeshConfig(fsdp=2, expert=1), jax.devices()[:2])

  def run(kernels):
    ctx = _context(seg).replace(execution=Execution(kernels=kernels))

    @jax.jit
    def value_and_grad(x):
      with activation_mesh(mesh):
        return jax.value_and_grad(lambda x: jnp.sum(jnp.sin(mixer(x, ctx)[0])))(x)

    return value_and_grad(x)

  fused, plain = run(KernelConfig(short_conv="pallas")), run(KernelConfig())
  for a, b in zip(fused, plain):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4,
                               atol=2e-4 * np.abs(np.asarray(b)).max())


def test_lora_adapter_gradients_flow():
  lora = LoRAConfig(targets=("q_proj", "k_proj", "v_proj", "o_proj"))
  graphdef, adapters, rest = nnx.split(_mixer(KIMI_LINEAR, lora=lora, seed=4), LoRAParam, ...)
  names = {str(path[0]) for path, _ in nnx.to_flat_state(adapters)}
  assert names == {"q_proj", "k_proj", "v_proj", "o_proj"}
  x = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, D)), jnp.float32)
  ctx = _context(np.ones((B, T), np.int32))

  @jax.jit
  @jax.grad
  def grads(adapters):
    return jnp.sum(nnx.merge(graphdef, adapters, rest)(x, ctx)[0]**2)

  for path, g in nnx.to_flat_state(grads(adapters)):
    g = np.asarray(g[...])
    assert np.isfinite(g).all() and np.abs(g).max() > 0, path

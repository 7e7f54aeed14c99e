"""Multi-head latent attention (hylora.model.mixers.mla) against a plain-numpy reference
of the whole mixer written from the published definitions (Kimi Linear's NoPE MLA,
DeepSeek-V3.2's MLA with YaRN and its sparse-attention indexer, Kimi K3's gated MLA)."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hylora.core.config import LoRAConfig, MLAConfig, ModelConfig
from hylora.core.errors import ConfigError
from hylora.model.context import ForwardContext
from hylora.model.init import ParamInit
from hylora.model.lora import LoRAParam
from hylora.model.mixers import MIXERS
from hylora.model.mixers.mla import LatentAttention
from hylora.model.rope import YaRN, rope_frequencies

D = 48
KIMI = MLAConfig(heads=4, q_rank=0, kv_rank=16, nope_dim=16, rope_dim=8, v_dim=12, rope=False,
                 block_q=8)
DEEPSEEK = MLAConfig(heads=4, q_rank=24, kv_rank=16, nope_dim=16, rope_dim=16, v_dim=12, rope=True,
                     rope_theta=10000.0, yarn_factor=40.0, yarn_original_max_positions=4096,
                     yarn_mscale=1.0, yarn_mscale_all_dim=1.0, index_topk=5, index_heads=16,
                     index_head_dim=32, block_q=8)
K3 = dataclasses.replace(KIMI, q_rank=20, output_gate=True)
LORA_NAMES = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")

# ---- the numpy reference ------------------------------------------------------------


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _yarn_inv_freq(dim, theta, factor, original, beta_fast, beta_slow):
  """YaRN's frequencies (float64): interpolate the slow dimensions by `factor`, keep the
  fast ones, a linear ramp between the correction dimensions."""
  base = 1.0 / theta**(np.arange(0, dim, 2) / dim)
  corr = lambda rot: dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(theta))
  low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
  ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 1e-3), 0, 1)
  return base / factor * ramp + base * (1 - ramp)


def _mscale(factor, m):
  return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _rotate_pairs(x, pos, inv, af):
  """Rotates each pair (x[2i], x[2i+1]) in place by pos * inv[i]."""
  ang = pos[..., None, None] * inv
  c, s = np.cos(ang) * af, np.sin(ang) * af
  out = np.empty_like(x)
  out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
  out[..., 1::2] = x[..., 1::2] * c + x[..., 0::2] * s
  return out


def _rotate_halves(x, pos, inv, af):
  """Rotates (x[i], x[i + D/2]) by pos * inv[i]."""
  ang = pos[..., None, None] * inv
  c, s = np.cos(ang) * af, np.sin(ang) * af
  x1, x2 = np.split(x, 2, axis=-1)
  return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _indexer_selection(p, c, x, q_latent, allowed, pos, inv, af):
  """bool [B, T, T]: the keys the indexer keeps for each query."""
  qi = np.einsum("btr,rhd->bthd", q_latent, p["indexer/wq_b"])
  ki = x @ p["indexer/wk"]
  mu, var = ki.mean(-1, keepdims=True), ki.var(-1, keepdims=True)
  ki = (ki - mu) / np.sqrt(var + 1e-6) * p["indexer/k_norm_scale"] + p["indexer/k_norm_bias"]
  r = c.rope_dim
  qi[..., :r] = _rotate_halves(qi[..., :r], pos, inv, af)
  ki[..., :r] = _rotate_halves(ki[:, :, None, :r], pos, inv, af)[:, :, 0]
  w = (x @ p["indexer/weights_proj"]) * c.index_heads**-0.5
  dots = np.maximum(np.einsum("bthd,bsd->bths", qi, ki) * c.index_head_dim**-0.5, 0)
  scores = np.einsum("bth,bths->bts", w, dots)
  keep = np.zeros_like(allowed)
  for b, t in np.ndindex(*allowed.shape[:2]):
    keys = np.flatnonzero(allowed[b, t])
    if len(keys) > c.index_topk:
      s = np.sort(scores[b, t, keys])[::-1]
      # no tie at the cut: how an implementation breaks ties cannot decide the test
      assert s[c.index_topk - 1] - s[c.index_topk] > 1e-5 * np.abs(s).max()
      keys = keys[np.argsort(-scores[b, t, keys])[:c.index_topk]]
    keep[b, t, keys] = True
  return keep


def reference(p, c: MLAConfig, x, seg, pos, eps):
  """The mixer in float64 numpy: p maps parameter paths to arrays."""
  x = np.asarray(x, np.float64)
  pos = np.asarray(pos, np.float64)
  b, t, _ = x.shape
  if c.q_rank:
    q_latent = _rms(x @ p["q_a_proj"], p["q_a_layernorm"], eps)
    q = np.einsum("btr,rhd->bthd", q_latent, p["q_b_proj"])
  else:
    q_latent, q = None, np.einsum("btd,dhe->bthe", x, p["q_proj"])
  latent = x @ p["kv_a_proj_with_mqa"]
  kv = np.einsum("btr,rhd->bthd", _rms(latent[..., :c.kv_rank], p["kv_a_layernorm"], eps),
                 p["kv_b_proj"])
  k_nope, v = kv[..., :c.nope_dim], kv[..., c.nope_dim:]
  q_nope, q_rope = q[..., :c.nope_dim], q[..., c.nope_dim:]
  k_rope = latent[:, :, None, c.kv_rank:]
  scale = (c.nope_dim + c.rope_dim)**-0.5
  inv, af = None, 1.0
  if c.rope:
    inv = _yarn_inv_freq(c.rope_dim, c.rope_theta, c.yarn_factor, c.yarn_original_max_positions,
                         c.yarn_beta_fast, c.yarn_beta_slow)
    if c.yarn_mscale_all_dim:
      af = _mscale(c.yarn_factor, c.yarn_mscale) / _mscale(c.yarn_factor, c.yarn_mscale_all_dim)
      scale *= _mscale(c.yarn_factor, c.yarn_mscale_all_dim)**2
    else:
      af = _mscale(c.yarn_factor, 1.0)
    q_rope, k_rope = _rotate_pairs(q_rope, pos, inv, af), _rotate_pairs(k_rope, pos, inv, af)
  q = np.concatenate([q_nope, q_rope], -1)
  k = np.concatenate([k_nope, np.broadcast_to(k_rope, (b, t, c.heads, c.rope_dim))], -1)
  seg = np.asarray(seg)
  allowed = np.tril(np.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :])
  if c.index_topk:
    allowed &= _indexer_selection(p, c, x, q_latent, allowed, pos, inv, af)
  logits = np.einsum("bthd,bshd->bhts", q, k) * scale
  logits = np.where(allowed[:, None], logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  o = np.einsum("bhts,bshd->bthd", probs, v)
  if c.output_gate:
    o = o / (1 + np.exp(-np.einsum("btd,dhe->bthe", x, p["g_proj"])))
  return np.einsum("bthd,hde->bte", o, p["o_proj"])


# ---- helpers ------------------------------------------------------------------------


def _model(c: MLAConfig, lora=None, seed=0):
  """The mixer in fp32 with random weights and random norm parameters."""
  # a model norm eps far from 1e-6: MLA's latent norms must not take it
  m = ModelConfig(d_model=D, mla=c, weight_dtype="float32", norm_eps=1e-2)
  build = lambda: LatentAttention(m, lora, init=ParamInit(seed))
  graph, _ = nnx.split(nnx.eval_shape(build))
  mod = nnx.merge(graph, jax.jit(lambda: nnx.split(build())[1])())  # one compile, not one per op
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(nnx.state(mod, nnx.Param)):
    name = "/".join(map(str, path))
    if "norm" in name:
      centre = 0.0 if name.endswith("bias") else 1.0
      var.set_value(
          jnp.asarray(centre + 0.3 * rng.standard_normal(var.get_value().shape), jnp.float32))
  return mod


def _params(mod) -> dict:
  """{parameter path without the trailing /kernel: float64 array} of the base weights."""
  out = {}
  for path, var in nnx.to_flat_state(nnx.state(mod, nnx.Param)):
    name = "/".join(map(str, path)).removesuffix("/kernel")
    out[name] = np.asarray(var.get_value(), np.float64)
  return out


def _packed_batch(seed, lengths=((13, 11), (24,))):
  """x [B, T, D] with each row packing the given document lengths; segment ids and
  positions that restart per document (offset, so that RoPE sees large positions)."""
  t = sum(lengths[0])
  seg = np.concatenate([
      np.concatenate([np.full(n, i) for i, n in enumerate(row)]) for row in lengths
  ]).reshape(len(lengths), t)
  pos = np.concatenate([np.concatenate([np.arange(n) for n in row]) for row in lengths
                       ]).reshape(len(lengths), t)
  x = np.random.default_rng(seed).standard_normal((len(lengths), t, D)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(seg, jnp.int32), jnp.asarray(pos * 37, jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def _apply(graph, state, x, seg, pos):
  return nnx.merge(graph, state)(x, ForwardContext(seg, pos))[0]


def _run(mod, x, seg, pos):
  return _apply(*nnx.split(mod), x, seg, pos)


def _check_against_reference(c: MLAConfig, seed=0):
  mod = _model(c, seed=seed)
  x, seg, pos = _packed_batch(seed + 1)
  got = np.asarray(_run(mod, x, seg, pos))
  want = reference(_params(mod), c, x, seg, pos, 1e-6)
  scale = np.abs(want).max()
  assert np.abs(got - want).max() < 1e-4 * scale, np.abs(got - want).max() / scale


# ---- tests --------------------------------------------------------------------------


def test_kimi_linear_form_matches_reference():
  _check_against_reference(KIMI)


@pytest.mark.parametrize("topk", [5, 64])  # fewer keys than the row, and more
def test_deepseek_form_with_yarn_and_indexer_matches_reference(topk):
  _check_against_reference(dataclasses.replace(DEEPSEEK, index_topk=topk))


def test_deepseek_attention_factor_without_mscale_all_dim():
  # mscale_all_dim 0: YaRN scales the rotated parts by mscale(factor), the softmax not
  _check_against_reference(dataclasses.replace(DEEPSEEK, yarn_mscale_all_dim=0.0), seed=2)


def test_k3_gated_form_matches_reference():
  _check_against_reference(K3)


@pytest.mark.parametrize("c", [KIMI, DEEPSEEK], ids=["full", "indexer"])
def test_two_packed_documents_equal_each_alone(c):
  mod = _model(c)
  rng = np.random.default_rng(3)
  first, second, filler = (rng.standard_normal((n, D)).astype(np.float32) for n in (13, 11, 13))
  # rows: [first | second] and [second | first], each document with its own positions
  packed = jnp.asarray(np.stack([np.concatenate([first, second]), np.concatenate([second, first])]))
  seg = jnp.asarray([[0] * 13 + [1] * 11, [0] * 11 + [1] * 13], jnp.int32)
  pos = jnp.asarray([list(range(13)) + list(range(11)),
                     list(range(11)) + list(range(13))], jnp.int32) * 37
  # alone: each document at the start of a one-segment row (what follows it is never seen)
  alone = jnp.asarray(
      np.stack([np.concatenate([first, filler[:11]]),
                np.concatenate([second, filler])]))
  together = np.asarray(_run(mod, packed, seg, pos))
  each = np.asarray(_run(mod, alone, jnp.zeros_like(seg), jnp.arange(24)[None].repeat(2, 0) * 37))
  np.testing.assert_allclose(together[0], np.concatenate([each[0, :13], each[1, :11]]), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(together[1], np.concatenate([each[1, :11], each[0, :13]]), rtol=1e-5,
                             atol=1e-5)


def test_yarn_frequencies_follow_the_published_formula():
  for dim, factor in ((16, 40.0), (64, 40.0), (64, 4.0)):
    inv, af = rope_frequencies(dim, 10000.0, YaRN(factor, 4096, 32.0, 1.0, 1.0, 1.0))
    np.testing.assert_allclose(inv, _yarn_inv_freq(dim, 10000.0, factor, 4096, 32, 1), rtol=1e-6)
    assert af == 1.0
  _, af = rope_frequencies(16, 10000.0, YaRN(40.0, 4096))
  assert af == pytest.approx(0.1 * math.log(40.0) + 1)
  plain, af = rope_frequencies(16, 10000.0)
  np.testing.assert_allclose(plain, 10000.0**(-np.arange(0, 16, 2) / 16), rtol=1e-6)
  assert af == 1.0


@pytest.mark.parametrize("c", [KIMI, dataclasses.replace(DEEPSEEK, output_gate=True)],
                         ids=["one_q_proj", "q_latent_gate_indexer"])
def test_lora_gradients_reach_every_adapter_and_only_them(c):
  lora = LoRAConfig(rank=2, targets=LORA_NAMES + ("g_proj", "wq_b", "wk", "weights_proj"))
  mod = _model(c, lora)
  x, seg, pos = _packed_batch(4)
  graph, adapters, rest = nnx.split(mod, LoRAParam, ...)

  @jax.jit
  def grads(adapters):
    loss = lambda a: jnp.sum(jnp.square(_run(nnx.merge(graph, a, rest), x, seg, pos)))
    return jax.grad(loss)(adapters)

  flat = {
      "/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads(adapters))
  }
  names = {n.split("/")[0] for n in flat}
  want = {"q_a_proj", "q_b_proj"} if c.q_rank else {"q_proj"}
  # the output gate and the indexer are frozen whatever the targets say
  assert names == want | {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
  for name, g in flat.items():
    assert np.all(np.isfinite(g)), name
    if name.endswith("lora_b"):  # B starts at zero, so only B's gradient is nonzero
      assert np.abs(g).max() > 0, name


def test_shapes_and_registration():
  assert MIXERS["mla"] is LatentAttention
  shapes = {
      n: v.shape
      for n, v in _params(_model(dataclasses.replace(DEEPSEEK, output_gate=True))).items()
  }
  assert shapes == {
      "q_a_proj": (D, 24),
      "q_a_layernorm": (24,),
      "q_b_proj": (24, 4, 32),
      "kv_a_proj_with_mqa": (D, 32),
      "kv_a_layernorm": (16,),
      "kv_b_proj": (16, 4, 28),
      "o_proj": (4, 12, D),
      "g_proj": (D, 4, 12),
      "indexer/wq_b": (24, 16, 32),
      "indexer/wk": (D, 32),
      "indexer/k_norm_scale": (32,),
      "indexer/k_norm_bias": (32,),
      "indexer/weights_proj": (D, 16),
  }


def test_indexer_needs_a_query_latent():
  with pytest.raises(ConfigError, match="model.mla.q_rank"):
    _model(dataclasses.replace(DEEPSEEK, q_rank=0))

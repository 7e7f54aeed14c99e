"""Group-limited routing (DeepSeek-V3's noaux_tc selection) against a numpy re-implementation
of the published definition; one group routes as before; the per-device selection under
a mesh picks the same experts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hylora.core.config import MeshConfig, MoEConfig
from hylora.core.errors import ConfigError
from hylora.model.ffn.router import Router
from hylora.model.init import ParamInit
from meshes.mesh import build_mesh
from meshes.rules import activation_mesh

D, E = 16, 32
CFG = MoEConfig(experts=E, top_k=6, expert_ffn=8, score_fn="sigmoid", normalize_top_k=True,
                routed_scale=2.5, groups=8, groups_kept=3)


def _router(cfg: MoEConfig, seed=0):
  router = Router(D, cfg, init_std=0.0, init=ParamInit(seed), dtype="float32")
  # A bias large enough to change which experts and groups are chosen.
  router.bias[...] = 0.3 * jax.random.normal(jax.random.key(seed + 1), (cfg.experts,))
  return router


def _numpy_routing(x, kernel, bias, cfg: MoEConfig):
  """(weights [N, k], experts [N, k]) as DeepSeek-V3's router defines them, token by token."""
  scores = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ kernel.astype(np.float64))))
  choice = scores + bias
  per_group = cfg.experts // cfg.groups
  weights, experts = [], []
  for s, c in zip(scores, choice):
    groups = c.reshape(cfg.groups, per_group)
    group_scores = np.sort(groups, axis=1)[:, -2:].sum(axis=1)
    kept = np.argsort(-group_scores)[:cfg.groups_kept]
    masked = np.full(cfg.experts, -np.inf)
    for g in kept:
      masked[g * per_group:(g + 1) * per_group] = groups[g]
    top = np.argsort(-masked)[:cfg.top_k]
    w = s[top]
    if cfg.normalize_top_k:
      w = w / (w.sum() + 1e-20)
    weights.append(w * cfg.routed_scale)
    experts.append(top)
  return np.array(weights), np.array(experts)


def _by_expert(weights, experts):
  """Each token's (experts, weights) sorted by expert: top-k order is unspecified."""
  order = np.argsort(experts, axis=1)
  return np.take_along_axis(experts, order, 1), np.take_along_axis(weights, order, 1)


def test_group_limited_routing_matches_the_published_definition():
  router = _router(CFG)
  x = jax.random.normal(jax.random.key(2), (64, D), jnp.float32)
  weights, experts, aux = jax.jit(lambda x: router(x))(x)
  ref_w, ref_e = _numpy_routing(np.asarray(x), np.asarray(router.kernel[...]),
                                np.asarray(router.bias[...]), CFG)
  got_e, got_w = _by_expert(np.asarray(weights), np.asarray(experts))
  want_e, want_w = _by_expert(ref_w, ref_e)
  np.testing.assert_array_equal(got_e, want_e)
  np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-6)
  # Every token's experts lie in at most groups_kept groups.
  per_group = E // CFG.groups
  assert max(len(set(row // per_group)) for row in got_e) <= CFG.groups_kept
  # The groups did change the choice for some tokens (else the test proves nothing).
  ungrouped = _numpy_routing(np.asarray(x), np.asarray(router.kernel[...]),
                             np.asarray(router.bias[...]),
                             MoEConfig(experts=E, top_k=CFG.top_k, groups=1))[1]
  assert np.any(np.sort(ungrouped, 1) != want_e)
  assert float(aux["expert_load"].sum()) == 64 * CFG.top_k


def test_one_group_routes_exactly_as_plain_top_k():
  cfg = MoEConfig(experts=E, top_k=6, score_fn="sigmoid", normalize_top_k=True, routed_scale=2.5)
  router = _router(cfg)
  x = jax.random.normal(jax.random.key(3), (64, D), jnp.float32)
  weights, experts, _ = router(x)
  scores = jax.nn.sigmoid(x @ router.kernel[...])
  plain = jax.lax.top_k(scores + router.bias[...], cfg.top_k)[1]
  w = jnp.take_along_axis(scores, plain, axis=-1)
  w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20) * cfg.routed_scale
  np.testing.assert_array_equal(experts, plain)
  np.testing.assert_array_equal(weights, w)
  # Every group kept: the same experts as no groups at all.
  all_kept = _router(MoEConfig(experts=E, top_k=6, score_fn="sigmoid", groups=4, groups_kept=4))
  np.testing.assert_array_equal(np.sort(all_kept(x)[1], 1), np.sort(plain, 1))


def test_per_device_selection_under_a_mesh_picks_the_same_experts():
  router = _router(CFG)
  b, t = 8, 8
  x = jax.random.normal(jax.random.key(4), (b * t, D), jnp.float32)
  _, expected, _ = router(x, seq_len=t)

  def run(x):
    with activation_mesh(build_mesh(MeshConfig(fsdp=2, expert=4))):
      return router(x, seq_len=t)[1]

  np.testing.assert_array_equal(jax.jit(run)(x), expected)


def test_impossible_groups_are_named():
  with pytest.raises(ConfigError, match="model.moe.groups"):
    _router(MoEConfig(experts=E, top_k=8, groups=8, groups_kept=1))  # 4 experts kept < 8
  with pytest.raises(ConfigError, match="model.moe.groups"):
    _router(MoEConfig(experts=E, top_k=2, groups=5, groups_kept=1))  # 32 not divisible

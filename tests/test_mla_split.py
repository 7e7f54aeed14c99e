"""MLA's full attention on a sequence split across devices (latent_attention_split.py)
equals the layer on one device, output and gradients, and gathers only the latent."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hylora.core.config import LoRAConfig, MeshConfig, MLAConfig, ModelConfig
from hylora.model.context import ForwardContext
from hylora.model.init import ParamInit
from hylora.model.lora import LoRAParam
from hylora.model.mixers.latent_attention_split import attention_over_gathered_keys
from hylora.model.mixers.mla import LatentAttention
from hylora.quant import PackedWeight
from meshes.mesh import build_mesh
from meshes.per_shard import sequence_split
from meshes.rules import activation_mesh

D, T = 48, 128
# nope-only (Kimi) and with YaRN RoPE on a query latent (DeepSeek), both gated (K3);
# key blocks of 8 on 16 queries per device: skipped, partial and diagonal blocks
KIMI = MLAConfig(heads=4, q_rank=0, kv_rank=16, nope_dim=16, rope_dim=8, v_dim=12, rope=False,
                 output_gate=True, block_k=8)
DEEPSEEK = MLAConfig(heads=4, q_rank=24, kv_rank=16, nope_dim=16, rope_dim=16, v_dim=12, rope=True,
                     rope_theta=10000.0, yarn_factor=40.0, yarn_original_max_positions=4096,
                     yarn_mscale=1.0, yarn_mscale_all_dim=1.0, output_gate=True, block_k=8)
LORA = LoRAConfig(
    rank=2, targets=("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))


def _layer(c: MLAConfig, seed=0):
  """The layer in fp32 with random weights, norm scales and adapters (B too, so that
  every adapter changes the output)."""
  m = ModelConfig(d_model=D, mla=c, weight_dtype="float32")
  mod = LatentAttention(m, LORA, init=ParamInit(seed))
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(nnx.state(mod, nnx.Any(nnx.Param, LoRAParam))):
    name = "/".join(map(str, path))
    if "norm" in name or name.endswith("lora_b"):
      centre = 1.0 if "norm" in name else 0.0
      var.set_value(
          jnp.asarray(centre + 0.3 * rng.standard_normal(var.get_value().shape), jnp.float32))
  return mod


def _batch(seed=1):
  """One sequence of T tokens: documents crossing the 16-token device ranges (one ends
  exactly at a range's end), positions restarting per document."""
  ends = (5, 48, 77, 128)
  seg = np.zeros(T, np.int32)
  pos = np.zeros(T, np.int32)
  start = 0
  for i, end in enumerate(ends):
    seg[start:end], pos[start:end] = i, np.arange(end - start) * 37
    start = end
  x = np.random.default_rng(seed).standard_normal((1, T, D)).astype(np.float32)
  probe = np.random.default_rng(seed + 1).standard_normal((1, T, D)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(seg[None]), jnp.asarray(pos[None]), jnp.asarray(probe)


def _gradients(mod, mesh):
  """(output, gradients of every adapter, gradient of x), under `mesh` (None: one
  device, no mesh), and the function's jaxpr."""
  graph, adapters, rest = nnx.split(mod, LoRAParam, ...)
  x, seg, pos, probe = _batch()

  def run(adapters, x):
    with activation_mesh(mesh):

      def loss(adapters, x):
        out = nnx.merge(graph, adapters, rest)(x, ForwardContext(seg, pos))[0]
        return jnp.sum(out * probe), out

      return jax.grad(loss, (0, 1), has_aux=True)(adapters, x)

  (g_adapters, g_x), out = jax.jit(run)(adapters, x)
  flat = {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(g_adapters)}
  return np.asarray(out), flat, np.asarray(g_x), jax.make_jaxpr(run)(adapters, x)


def _sub_jaxprs(params):
  for value in params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      inner = getattr(item, "jaxpr", item)
      if hasattr(inner, "eqns"):
        yield inner


def _equations(jaxpr, inside=False):
  """(equation, whether it is inside a shard_map) for every equation, nested ones too."""
  for eqn in jaxpr.eqns:
    yield eqn, inside
    for sub in _sub_jaxprs(eqn.params):
      yield from _equations(sub, inside or eqn.primitive.name == "shard_map")


def _assert_close(got, want, name):
  err = np.abs(got - want).max() / np.abs(want).max()
  assert err < 1e-5, f"{name}: relative error {err}"


MESHES = {
    "one_axis": lambda: jax.sharding.Mesh(np.asarray(jax.devices()[:8]), ("fsdp",)),
    "both_axes": lambda: build_mesh(MeshConfig(fsdp=2, expert=4)),
}


def _packed_kv_b_proj(mod):
  """mod with kv_b_proj's base weight packed (block FP8), as a quantized checkpoint ships it."""
  kernel = mod.kv_b_proj.kernel
  kernel.set_value(PackedWeight.from_kernel(kernel.get_value(), "fp8_block", 1, 0))
  return mod


@functools.cache
def _one_device(c: MLAConfig, packed: bool):
  mod = _layer(c)
  return _gradients(_packed_kv_b_proj(mod) if packed else mod, None)[:3]


def _check_split_equals_one_device(c: MLAConfig, mesh_name: str, packed: bool = False):
  mesh = MESHES[mesh_name]()
  mod = _packed_kv_b_proj(_layer(c)) if packed else _layer(c)
  with activation_mesh(mesh):
    split = sequence_split(_batch()[0])
  assert split is not None and split[1] is None  # one sequence: over every device
  want_out, want_grads, want_gx = _one_device(c, packed)
  out, grads, g_x, jaxpr = _gradients(mod, mesh)

  _assert_close(out, want_out, "output")
  _assert_close(g_x, want_gx, "x")
  assert set(grads) == set(want_grads)
  assert {n.split("/")[0] for n in grads} >= {"kv_b_proj", "o_proj", "kv_a_proj_with_mqa"}
  for name in want_grads:
    assert np.abs(want_grads[name]).max() > 0, name
    _assert_close(grads[name], want_grads[name], name)
  return jaxpr


@pytest.mark.parametrize("c", [KIMI, DEEPSEEK], ids=["kimi_nope", "deepseek_rope"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_split_sequence_equals_one_device_and_gathers_only_the_latent(c, mesh_name):
  jaxpr = _check_split_equals_one_device(c, mesh_name)

  # Only the latent, the rope key and the segment ids cross devices, forward and back.
  eqns = list(_equations(jaxpr.jaxpr))
  gathered = {
      tuple(v.aval.shape) for e, _ in eqns if e.primitive.name in ("all_gather", "reduce_scatter")
      for v in (e.outvars if e.primitive.name == "all_gather" else e.invars)
  }
  assert gathered == {(1, T, c.kv_rank), (1, T, c.rope_dim), (1, T)}, gathered
  # Nothing inside spans every key times heads (K/V: T x H x 28, scores: 16 x T x H), nor
  # a stack of per-block query-sized state.
  largest = max((v.aval.size, str(v.aval)) for e, inside in eqns if inside for v in e.outvars
                if hasattr(v.aval, "size"))
  assert largest[0] <= T * max(c.kv_rank, c.rope_dim), largest
  # Causal work balanced: half the queries (and their segment ids) to the device of the
  # mirrored half-block and the outputs back, both halves, forward and back.
  moved = [e for e, _ in eqns if e.primitive.name == "ppermute"]
  assert len(moved) >= 4 and all(v.aval.shape[1] == T // 16 for e in moved for v in e.invars)


def test_packed_kv_b_proj_on_a_split_sequence_equals_one_device():
  _check_split_equals_one_device(KIMI, "both_axes", packed=True)


def test_scanned_layers_keep_nothing_per_key_block():
  """Differentiated inside a scan over layers, as the layer stack runs it, the split layer
  keeps no per-key-block state: no [n_blocks, ...] scores, masks or values in the compiled
  program (linearizing a scan hoists its loop-invariant integer work, such as the masks,
  out of the loop, one per block, unless the attention hides it)."""
  graph, adapters, rest = nnx.split(_layer(KIMI), LoRAParam, ...)
  x, seg, pos, probe = _batch()
  mesh = MESHES["one_axis"]()

  def run(adapters, xs):
    with activation_mesh(mesh):

      def loss(adapters):

        def layer(h, x):
          return nnx.merge(graph, adapters, rest)(x + h, ForwardContext(seg, pos))[0], None

        return jnp.sum(jax.lax.scan(layer, jnp.zeros_like(x), xs)[0] * probe)

      return jax.value_and_grad(loss)(adapters)

  hlo = jax.jit(run).lower(adapters, jnp.stack([x, 2 * x])).compile().as_text()
  n_blocks = T // KIMI.block_k
  stacked = set(re.findall(rf"\w+\[{n_blocks}(?:,\d+){{4,}}\]", hlo))
  assert not stacked, stacked


def test_attention_gradients_equal_dense_attention_with_dropout():
  """The blockwise attention's custom VJP equals autodiff of dense attention over the same
  up-projected keys (each block's dropout mask from the key folded with its start): the
  gradients of q, the latent, the rope key and every float weight; an integer weight
  leaf gets none. Keys: 5 blocks of 8 (the last padded), 2 documents, queries 20..31."""
  b, t, tq, h, r, nope, rope_dim, v, block_k, offset, scale = 2, 37, 12, 3, 6, 5, 4, 7, 8, 20, 0.3
  keys = jax.random.split(jax.random.key(0), 7)
  weights = dict(w=jax.random.normal(keys[0], (r, h, nope + v)),
                 bias=jax.random.normal(keys[1], (h, nope + v)), codes=jnp.arange(4))

  def up_project(w, latent, key):
    if key is not None:
      latent = latent * jax.random.bernoulli(key, 0.7, latent.shape) / 0.7
    return jnp.einsum("bkr,rhd->bkhd", latent, w["w"]) + w["bias"] + 0 * w["codes"][0]

  q = jax.random.normal(keys[2], (b, tq, h, nope + rope_dim))
  latent = jax.random.normal(keys[3], (b, t, r))
  k_rope = jax.random.normal(keys[4], (b, t, rope_dim))
  seg_k = jnp.asarray(np.repeat([[0] * 15 + [1] * (t - 15)], b, 0), jnp.int32)
  seg_q = seg_k[:, offset:offset + tq]
  probe = jax.random.normal(keys[5], (b, tq, h, v))

  def dense(w, q, latent, k_rope, dropout_key):
    kv = jnp.concatenate([
        up_project(w, latent[:, i:i + block_k], jax.random.fold_in(dropout_key, i))
        for i in range(0, t, block_k)
    ], 1)
    s = jnp.einsum("bqhd,bkhd->bhqk", q[..., :nope], kv[..., :nope])
    s = (s + jnp.einsum("bqhd,bkd->bhqk", q[..., nope:], k_rope)) * scale
    q_pos, k_pos = offset + jnp.arange(tq), jnp.arange(t)
    ok = (k_pos[None, None] <= q_pos[None, :, None]) & (seg_k[:, None] == seg_q[:, :, None])
    p = jax.nn.softmax(jnp.where(ok[:, None], s, -jnp.inf), -1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, kv[..., nope:])

  def blockwise(w, q, latent, k_rope, dropout_key):
    return attention_over_gathered_keys(up_project, w, dropout_key, q, latent, k_rope, seg_q, seg_k,
                                        jnp.int32(offset), nope_dim=nope, scale=scale,
                                        block_k=block_k)

  grads = {}
  for name, attend in (("dense", dense), ("blockwise", blockwise)):
    loss = lambda *a: jnp.sum(attend(*a, keys[6]) * probe)
    grads[name] = jax.jit(jax.grad(loss, (0, 1, 2, 3), allow_int=True))(weights, q, latent, k_rope)
  want = dict(jax.tree_util.tree_leaves_with_path(grads["dense"]))
  for path, got in jax.tree_util.tree_leaves_with_path(grads["blockwise"]):
    name = jax.tree_util.keystr(path)
    if "codes" in name:
      assert got.dtype == jax.dtypes.float0, name
    else:
      _assert_close(np.asarray(got), np.asarray(want[path]), name)

"""HF-layout base weights: the name table, a written-then-loaded round trip (same arrays,
shardings and logits), per-slice lazy reads, and the named error of each bad folder."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from helpers import small_config
from hylora.io import hf_weights
from hylora.core.errors import ConfigError, WeightsError
from hylora.io.hf_names import plan
from hylora.model import ForwardContext
from hylora.train import state as st
from weights_helpers import host, model_and_trees, read_folder


@pytest.fixture(scope="module")
def model():
  cfg = small_config()
  mesh, parts, lora, frozen = model_and_trees(cfg)
  return cfg, mesh, parts, lora, frozen


@pytest.fixture(scope="module")
def written(model, tmp_path_factory):
  cfg, _, _, _, frozen = model
  path = tmp_path_factory.mktemp("hf") / "base"
  files = hf_weights.save(path, cfg, frozen, max_shard_bytes=120_000)
  assert len(files) > 1  # several shards + an index
  return path


def test_table_names_every_parameter_once():
  cfg = small_config()
  for variant in (cfg,
                  dataclasses.replace(
                      cfg, model=dataclasses.replace(
                          cfg.model, layers=8,
                          dense_layers=0))):  # repeated periods: a stacked `layers` axis > 1
    parts = st.model_parts(variant)
    _, frozen = st.abstract_arrays(parts)
    names = [n for leaf in plan(variant, frozen) for _, ns in leaf.items() for n in ns]
    assert len(names) == len(set(names))
    layers = variant.model.layers
    assert f"model.layers.{layers - 1}.self_attn.indexer.k_proj.weight" in names
    assert f"model.layers.{layers - 2}.self_attn.f_b_proj.weight" in names
    assert ("model.layers.0.mlp.gate_proj.weight" in names) == (variant.model.dense_layers > 0)
    assert f"model.layers.{layers - 1}.mlp.experts.7.down_proj.weight" in names
    assert not any("mlp.experts.8." in n for n in names)


def test_written_tensors_follow_the_hf_layout(model, written):
  cfg, _, _, _, frozen = model
  f, t = host(frozen), read_folder(written)
  layer = f["stack"]["segments"][0]["periods"]["layers"]
  q = layer[0]["mixer"]["q"]["kernel"][0]  # [d, heads, head_dim]
  np.testing.assert_array_equal(t["model.layers.0.self_attn.q_proj.weight"],
                                q.reshape(q.shape[0], -1).T)
  o = layer[2]["mixer"]["o"]["kernel"][0]  # [heads, head_dim, d]
  np.testing.assert_array_equal(t["model.layers.2.self_attn.o_proj.weight"],
                                o.reshape(-1, o.shape[-1]).T)
  gate_up = layer[1]["ffn"]["experts"]["gate_up"][0, 3]  # expert 3: [d, 2f]
  half = cfg.model.moe.expert_ffn
  np.testing.assert_array_equal(t["model.layers.1.mlp.experts.3.gate_proj.weight"],
                                gate_up[:, :half].T)
  np.testing.assert_array_equal(t["model.layers.1.mlp.experts.3.up_proj.weight"], gate_up[:,
                                                                                          half:].T)
  np.testing.assert_array_equal(t["lm_head.weight"], f["lm_head"].T)
  np.testing.assert_array_equal(t["model.embed_tokens.weight"], f["embed"])
  assert t["model.layers.0.input_layernorm.weight"].dtype == np.float32
  assert not any("placement" in n for n in t)  # the slot table is not a checkpoint tensor
  config = json.loads((written / "config.json").read_text())
  assert config["hidden_size"] == cfg.model.d_model
  assert config["n_routed_experts"] == cfg.model.moe.experts


def test_round_trip_gives_same_arrays_and_logits(model, written):
  cfg, mesh, parts, lora, frozen = model
  _, frozen_abstract = st.abstract_arrays(parts, mesh)
  loaded, _ = hf_weights.load(written, cfg, frozen_abstract)
  for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(loaded)):
    assert a.sharding == b.sharding and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 64)))
  ctx = ForwardContext(jnp.ones((2, 64), jnp.int32), jnp.broadcast_to(jnp.arange(64), (2, 64)))
  logits = jax.jit(lambda lo, fr: parts.merge(lo, fr).logits(tokens, ctx))
  want, got = logits(lora, frozen), logits(lora, loaded)
  assert np.isfinite(np.asarray(want)).all()
  np.testing.assert_array_equal(np.asarray(want), np.asarray(got))


def test_each_device_slice_is_read_once_and_alone(model, written, monkeypatch):
  cfg, mesh, parts, _, _ = model
  reads = []
  original = hf_weights.CheckpointFiles.read

  def spy(self, tensor, index):
    block = original(self, tensor, index)
    reads.append((tensor, block.size))
    return block

  monkeypatch.setattr(hf_weights.CheckpointFiles, "read", spy)
  _, frozen_abstract = st.abstract_arrays(parts, mesh)
  hf_weights.load(written, cfg, frozen_abstract)
  embed = [size for name, size in reads if name == "model.embed_tokens.weight"]
  vocab, d = cfg.model.vocab_size, cfg.model.d_model
  assert len(embed) == mesh.size and set(embed) == {vocab * d // mesh.size}  # 8 shards of 1/8
  total = {}
  for name, size in reads:
    total[name] = total.get(name, 0) + size
  full = read_folder(written)
  # replicated and sharded tensors alike: every element read exactly once
  assert all(total[name] == full[name].size for name in full)


def _rewrite(path, name, change):
  """Copies of `path` with tensor `name` replaced by change(array) (None: removed)."""
  index_path = path / hf_weights.INDEX_FILE
  index = json.loads(index_path.read_text())
  file = path / index["weight_map"][name]
  with safe_open(str(file), framework="numpy") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  value = change(tensors.pop(name))
  if value is None:
    del index["weight_map"][name]
  else:
    tensors[name] = value
  save_file(tensors, str(file))
  index_path.write_text(json.dumps(index))


@pytest.fixture
def broken(written, tmp_path):
  copy = tmp_path / "broken"
  shutil.copytree(written, copy)
  return copy


Q = "model.layers.3.self_attn.q_proj.weight"


@pytest.mark.parametrize("case, message", [
    ("missing", f"tensor '{Q}' is missing"),
    ("unexpected", "unexpected tensor 'model.layers.3.self_attn.extra.weight'"),
    ("shape", f"tensor '{Q}' in model-0000"),
    ("dtype", "dtype I32"),
    ("truncated", "truncated or corrupt"),
    ("config", "model.d_model"),
])
def test_bad_folders_name_the_tensor(model, broken, case, message):
  cfg, mesh, parts, _, _ = model
  if case == "missing":
    _rewrite(broken, Q, lambda a: None)
  elif case == "unexpected":
    index = json.loads((broken / hf_weights.INDEX_FILE).read_text())
    shard = broken / index["weight_map"][Q]
    with safe_open(str(shard), framework="numpy") as f:
      tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.layers.3.self_attn.extra.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, str(shard))
  elif case == "shape":
    _rewrite(broken, Q, lambda a: a[:-1])
  elif case == "dtype":
    _rewrite(broken, Q, lambda a: a.astype(np.int32))
  elif case == "truncated":
    index = json.loads((broken / hf_weights.INDEX_FILE).read_text())
    shard = broken / index["weight_map"][Q]
    shard.write_bytes(shard.read_bytes()[:-100])
  elif case == "config":
    config = json.loads((broken / "config.json").read_text())
    config["hidden_size"] = 48
    (broken / "config.json").write_text(json.dumps(config))
  _, frozen_abstract = st.abstract_arrays(parts, mesh)
  error = ConfigError if case == "config" else WeightsError
  with pytest.raises(error) as info:
    hf_weights.load(broken, cfg, frozen_abstract)
  assert message in str(info.value)
  if case == "shape":
    assert "shape [63, 32]" in str(info.value) and "expects [64, 32]" in str(info.value)
  if case == "truncated":
    assert "should hold" in str(info.value)  # the tensors the index places in that file

"""PEFT export: file layout, tensor names and shapes, factor values (fused gate_up split,
per-expert adapters), and the merged model = base + (alpha / r) * B @ A."""

import json

import numpy as np
import pytest
from safetensors import safe_open

from helpers import small_config
from hylora.io import hf_weights
from hylora.io import peft_export
from hylora.train import state as st
from weights_helpers import host, model_and_trees, read_folder

P = "base_model.model."


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  cfg = small_config()
  mesh, parts, lora, frozen = model_and_trees(cfg, seed=3)
  out = tmp_path_factory.mktemp("peft") / "adapter"
  hf_weights.save(out.parent / "base", cfg, frozen)
  peft_export.export(out, cfg, frozen, lora, merge=True)
  with safe_open(str(out / peft_export.ADAPTER_FILE), framework="numpy") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  return cfg, mesh, parts, host(lora), host(frozen), out, tensors


def _expected_modules(cfg):
  modules = []
  for i, (_, ffn) in enumerate(cfg.model.layer_kinds()):
    modules += [f"model.layers.{i}.self_attn.{m}_proj" for m in "qkvo"]
    if ffn == "dense":
      modules += [f"model.layers.{i}.mlp.{m}_proj" for m in ("gate", "up")]
    else:
      modules += [f"model.layers.{i}.mlp.shared_experts.{m}_proj" for m in ("gate", "up")]
      modules += [
          f"model.layers.{i}.mlp.experts.{e}.{m}_proj" for e in range(cfg.model.moe.experts)
          for m in ("gate", "up")
      ]
  return modules


def test_files_names_and_shapes_follow_peft(exported):
  cfg, _, _, _, _, out, tensors = exported
  config = json.loads((out / peft_export.CONFIG_FILE).read_text())
  assert config["peft_type"] == "LORA" and config["r"] == cfg.lora.rank
  assert config["lora_alpha"] == cfg.lora.alpha
  assert config["target_modules"] == [
      "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"
  ]
  want = {f"{P}{m}.lora_{ab}.weight" for m in _expected_modules(cfg) for ab in "AB"}
  assert set(tensors) == want
  r, d = cfg.lora.rank, cfg.model.d_model
  la, sa, moe = cfg.model.linear_attention, cfg.model.sparse_attention, cfg.model.moe
  shapes = {
      "model.layers.0.self_attn.q_proj.lora_A.weight": (r, d),
      "model.layers.0.self_attn.q_proj.lora_B.weight": (la.heads * la.head_dim, r),
      "model.layers.0.self_attn.o_proj.lora_A.weight": (r, la.heads * la.head_dim),
      "model.layers.0.self_attn.o_proj.lora_B.weight": (d, r),
      "model.layers.3.self_attn.k_proj.lora_B.weight": (sa.kv_heads * sa.head_dim, r),
      "model.layers.0.mlp.gate_proj.lora_B.weight": (cfg.model.dense_ffn, r),
      "model.layers.2.mlp.experts.5.up_proj.lora_A.weight": (r, d),
      "model.layers.2.mlp.experts.5.up_proj.lora_B.weight": (moe.expert_ffn, r),
  }
  for name, shape in shapes.items():
    assert tensors[P + name].shape == shape and tensors[P + name].dtype == np.float32, name


def test_factor_values(exported):
  cfg, _, _, lora, _, _, tensors = exported
  layers = lora["stack"]["segments"][0]["periods"]["layers"]
  q = layers[0]["mixer"]["q"]
  np.testing.assert_array_equal(tensors[P + "model.layers.0.self_attn.q_proj.lora_A.weight"],
                                q["lora_a"][0].T)
  np.testing.assert_array_equal(tensors[P + "model.layers.0.self_attn.q_proj.lora_B.weight"],
                                q["lora_b"][0].reshape(cfg.lora.rank, -1).T)
  experts, f = layers[2]["ffn"]["experts"], cfg.model.moe.expert_ffn
  for e in (0, 5):
    a, b = experts["lora_a"][0, e], experts["lora_b"][0, e]  # [d, r], [r, 2f]
    gate = P + f"model.layers.2.mlp.experts.{e}.gate_proj"
    up = P + f"model.layers.2.mlp.experts.{e}.up_proj"
    np.testing.assert_array_equal(tensors[gate + ".lora_A.weight"], a.T)
    np.testing.assert_array_equal(tensors[up + ".lora_A.weight"], a.T)  # shared A, written twice
    np.testing.assert_array_equal(tensors[gate + ".lora_B.weight"], b[:, :f].T)
    np.testing.assert_array_equal(tensors[up + ".lora_B.weight"], b[:, f:].T)


def test_merge_is_base_plus_scaled_b_a(exported):
  cfg, mesh, parts, _, _, out, tensors = exported
  base, merged = read_folder(out.parent / "base"), read_folder(out / "merged")
  assert set(base) == set(merged)
  scale = cfg.lora.alpha / cfg.lora.rank  # PEFT: lora_alpha / r
  adapted = {n[len(P):].rsplit(".lora_", 1)[0] + ".weight" for n in tensors}
  for name in base:
    if name not in adapted:
      np.testing.assert_array_equal(merged[name], base[name], err_msg=name)
      continue
    module = P + name[:-len(".weight")]
    delta = tensors[module + ".lora_B.weight"] @ tensors[module + ".lora_A.weight"]
    want = base[name].astype(np.float32) + scale * delta
    assert np.abs(delta).max() > 0, name
    # bf16 weights: within one rounding step of the fp32 sum
    np.testing.assert_allclose(merged[name].astype(np.float32), want, rtol=2**-7, atol=1e-6,
                               err_msg=name)
  # the merged folder is itself loadable base weights
  _, frozen_abstract = st.abstract_arrays(parts, mesh)
  hf_weights.load(out / "merged", cfg, frozen_abstract)

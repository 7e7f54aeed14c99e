"""Released checkpoints as their publishers ship them: tiny random Kimi Linear and
DeepSeek-V3.2 checkpoints saved by Hugging Face transformers (experiments/hf_fixtures.py)
load through the family name maps, and the stack's fp32 logits equal transformers' own;
bad folders are one-line errors naming the tensor and the file."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from experiments import hf_logits
from hylora.core.errors import ConfigError, WeightsError

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
FAMILIES = ("kimi_linear", "deepseek_v32")


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(family):
  folder = FIXTURES / family
  want = np.load(folder / "logits.npy")
  got = hf_logits.logits(str(folder), np.load(folder / "input_ids.npy"))
  assert got.shape == want.shape
  err = np.abs(got - want).max()
  assert err <= 1e-4 * np.abs(want).max(), f"{family}: max abs error {err}"


def test_the_command_writes_the_logits(tmp_path):
  folder = FIXTURES / "kimi_linear"
  ids = np.load(folder / "input_ids.npy")[:1, :16]
  np.save(tmp_path / "ids.npy", ids)
  rc = hf_logits.main([
      "--base-weights",
      str(folder), "--input-ids",
      str(tmp_path / "ids.npy"), "--out",
      str(tmp_path / "out.npy")
  ])
  assert rc == 0
  assert np.load(tmp_path / "out.npy").shape == (1, 16, 128)


def _copy(tmp_path, family="deepseek_v32") -> Path:
  folder = tmp_path / family
  shutil.copytree(FIXTURES / family, folder)
  return folder


def _edit(folder: Path, change):
  path = folder / "model.safetensors"
  tensors = load_file(str(path))
  change(tensors)
  save_file(tensors, str(path))


Q_B = "model.layers.1.self_attn.q_b_proj.weight"


@pytest.mark.parametrize("case, error, words", [
    ("missing", WeightsError, [Q_B, "missing"]),
    ("unexpected", WeightsError, ["model.layers.1.self_attn.extra.weight", "model.safetensors"]),
    ("shape", WeightsError, [Q_B, "shape", "model.safetensors"]),
    ("model_type", ConfigError, ["'mamba'", "supported", "kimi_linear"]),
    ("layer_lists", ConfigError, ["full_attn_layers", "1-based"]),
])
def test_bad_released_folders_are_one_line_errors(tmp_path, case, error, words):
  family = "kimi_linear" if case == "layer_lists" else "deepseek_v32"
  folder = _copy(tmp_path, family)
  ids = np.load(folder / "input_ids.npy")[:1, :8]
  config = json.loads((folder / "config.json").read_text())
  if case == "missing":
    _edit(folder, lambda t: t.pop(Q_B))
  elif case == "unexpected":
    _edit(folder, lambda t: t.update({"model.layers.1.self_attn.extra.weight": np.zeros(2)}))
  elif case == "shape":
    _edit(folder, lambda t: t.update({Q_B: t[Q_B][:-1]}))
  elif case == "model_type":
    config["model_type"] = "mamba"
  elif case == "layer_lists":
    config["linear_attn_config"]["full_attn_layers"] = [3, 6]  # 6 > 5 layers
    config.pop("layer_types", None)
  (folder / "config.json").write_text(json.dumps(config))
  with pytest.raises(error) as info:
    hf_logits.logits(str(folder), ids)
  message = str(info.value)
  assert "\n" not in message
  for word in words:
    assert word in message, message


def test_ignored_tensors_are_skipped_and_mtp_layers_by_default(tmp_path):
  folder = _copy(tmp_path)
  ids = np.load(folder / "input_ids.npy")[:1, :8]
  want = hf_logits.logits(str(folder), ids)
  extra = {
      "vision_tower.patch.weight": np.ones(3, np.float32),
      "model.layers.3.eh_proj.weight": np.ones(2, np.float32)
  }  # an MTP layer
  _edit(folder, lambda t: t.update(extra))
  config = json.loads((folder / "config.json").read_text())
  config["num_nextn_predict_layers"] = 1
  (folder / "config.json").write_text(json.dumps(config))
  with pytest.raises(WeightsError, match="vision_tower.patch.weight"):
    hf_logits.logits(str(folder), ids)
  got = hf_logits.logits(str(folder), ids, ignore_tensors=r"^vision_tower\.")
  np.testing.assert_array_equal(got, want)


def test_peft_export_uses_the_checkpoint_names(tmp_path):
  """Targets given in Kimi Linear's module names adapt the model; the adapter comes out
  under the checkpoint's own names (routed experts per expert as w1 / w3, shared experts
  under block_sparse_moe, MLA's kv_b_proj)."""
  import dataclasses

  import jax
  from hylora.io import hf_weights, peft_export
  from hylora.train import state as st
  from meshes.mesh import AXES

  folder = str(FIXTURES / "kimi_linear")
  cfg = hf_logits.checkpoint_config(folder)
  cfg = dataclasses.replace(
      cfg, lora=dataclasses.replace(
          cfg.lora, rank=2, alpha=4.0,
          targets=("q_proj", "kv_b_proj", "experts.*.w1", "shared_experts.up_proj")))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), AXES)
  parts = st.model_parts(cfg)
  lora, _ = st.init_params(cfg, parts, mesh)
  _, frozen_abstract = st.abstract_arrays(parts, mesh)
  frozen, lora = hf_weights.load(folder, cfg, frozen_abstract, lora)
  out = peft_export.export(tmp_path / "adapter", cfg, frozen, lora)
  names = set(load_file(str(out / peft_export.ADAPTER_FILE)))
  prefix = "base_model.model.model.layers."
  for name in ("0.self_attn.q_proj", "2.self_attn.q_proj", "2.self_attn.kv_b_proj",
               "1.block_sparse_moe.experts.7.w1", "1.block_sparse_moe.experts.7.w3",
               "1.block_sparse_moe.shared_experts.gate_proj"):
    assert f"{prefix}{name}.lora_A.weight" in names, name
  assert not any("self_attn.o_proj" in n or "mlp.gate_proj" in n for n in names)
  config = json.loads((out / peft_export.CONFIG_FILE).read_text())
  assert {"q_proj", "kv_b_proj", "w1", "w3", "gate_proj",
          "up_proj"} == set(config["target_modules"])
  assert config["r"] == 2 and config["lora_alpha"] == 4.0

"""A frozen base that stays packed: the checkpoint config's quantization read into the
model config, tiny checkpoints of every packed format (block FP8, MXFP4, INT4) loaded
with their codes bit-exact and only each device's slices read, written back byte for byte,
merged only into an explicit bf16 copy, and every bad folder a one-line error."""

import dataclasses
import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import quant_helpers as qh
from hylora.core import families
from hylora.core.config import ModelConfig, QuantizationConfig
from hylora.core.errors import ConfigError, WeightsError
from hylora.io import hf_weights, peft_export
from hylora.io.hf_names import packed_formats, plan
from hylora.quant.packed_weight import PackedWeight, is_packed

# ---- config.json -> model.quantization --------------------------------------------------


def _read(quantization_config, model_type="deepseek_v32"):
  hf = qh.fixture_config(model_type)
  hf["quantization_config"] = quantization_config
  return families.architecture(hf, ModelConfig()).quantization


def test_released_configs_name_their_formats():
  read = lambda name: families.architecture(families.published(name), ModelConfig()).quantization
  assert read("kimi-linear") == QuantizationConfig()
  assert read("deepseek-v3.2") == QuantizationConfig("fp8_block", ("re:.*indexer\\.weights_proj$",))
  k3 = read("kimi-k3")
  assert k3.format == "mxfp4"
  assert "re:.*shared_experts.*" in k3.ignore and "re:.*self_attn.*" in k3.ignore
  assert "re:.*block_sparse_moe\\.routed_expert_(down|up)_proj.*" in k3.ignore


def test_compressed_tensors_int4_and_minimax_fp8_configs():
  q = _read(qh.INT4_CONFIG, "kimi_linear")
  assert q == QuantizationConfig("int4", tuple(qh.INT4_CONFIG["ignore"]))
  minimax = dict(qh.FP8_CONFIG, fmt="float8_e4m3fn",
                 modules_to_not_convert=["gate", "e_score_correction_bias", "lm_head"])
  q = _read(minimax)
  assert q.format == "fp8_block"
  from hylora.io.hf_names import ignored_module
  # transformers' rule: a name from the start, or a name's tail
  assert ignored_module("model.layers.3.block_sparse_moe.gate", q.ignore)
  assert ignored_module("lm_head", q.ignore)
  assert not ignored_module("model.layers.3.block_sparse_moe.experts.0.w1", q.ignore)
  assert not ignored_module("model.layers.3.mlp.gate_proj", q.ignore)
  assert ignored_module("model.layers.3.self_attn.indexer.weights_proj", q.ignore)


@pytest.mark.parametrize("change, words", [
    (dict(quant_method="awq"), ["quant_method", "'awq'", "supported: fp8"]),
    (dict(fmt="e5m2"), ["fmt", "'e5m2'", "e4m3"]),
    (dict(weight_block_size=[64, 64]), ["weight_block_size", "[64, 64]", "[128, 128]"]),
    (dict(quant_method="compressed-tensors", format="nvfp4-pack-quantized"),
     ["format", "'nvfp4-pack-quantized'", "mxfp4-pack-quantized"]),
    (dict(bits=8), ["num_bits", "8", "4"]),
    (dict(group=128), ["group_size", "128", "32"]),
    (dict(symmetric=False), ["symmetric", "False", "True"]),
])
def test_unsupported_quantization_is_a_one_line_error(change, words):
  if {"bits", "group", "symmetric"} & set(change):
    qc = json.loads(json.dumps(qh.INT4_CONFIG))
    weights = qc["config_groups"]["group_0"]["weights"]
    weights.update(num_bits=change.get("bits", 4), group_size=change.get("group", 32),
                   symmetric=change.get("symmetric", True))
  else:
    qc = dict(qh.FP8_CONFIG, **change)
  with pytest.raises(ConfigError) as info:
    _read(qc)
  message = str(info.value)
  assert "\n" not in message and "config.json" in message
  for word in words:
    assert word in message, message


def test_house_config_carries_the_quantization():
  cfg = qh.config("int4")
  hf = json.loads(json.dumps(hf_weights.hf_config(cfg)))
  assert families.architecture(hf, cfg.model).quantization == cfg.model.quantization
  assert families.mismatch(hf, cfg.model) is None


def test_fp8_parts_of_a_fused_linear_must_own_whole_blocks():
  hf = qh.hf_config("fp8_block")
  hf["moe_intermediate_size"] = 96  # experts' gate and up: 96 rows each
  cfg = qh.released_config(hf)
  from hylora.train import state as st
  _, frozen = st.abstract_arrays(st.model_parts(qh.bf16_twin(cfg)))
  with pytest.raises(ConfigError, match="96 outputs each, not a multiple of its 128-row"):
    packed_formats(cfg, frozen)


# ---- folders of every format -----------------------------------------------------------


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
  """fmt -> (Quantized, its checkpoint folder, its bf16 twin folder), each built once."""
  built = {}

  def get(fmt):
    if fmt not in built:
      q = qh.build(fmt)
      root = tmp_path_factory.mktemp(fmt)
      built[fmt] = (q, qh.write_folder(q,
                                       root / "base"), qh.write_folder(q, root / "twin", twin=True))
    return built[fmt]

  return get


@pytest.fixture(scope="module", params=qh.FORMATS)
def quantized(request, bases):
  q, folder, _ = bases(request.param)
  q.cfg = dataclasses.replace(
      q.cfg, checkpoint=dataclasses.replace(q.cfg.checkpoint, base_weights=str(folder)))
  frozen, _ = hf_weights.load(folder, q.cfg, q.frozen_packed)
  return q, folder, frozen


def test_the_formats_pack_what_their_releases_pack(quantized):
  q, _, _ = quantized
  packed = {"/".join(map(str, p)) for p in packed_formats(q.cfg, q.frozen_bf16)}
  fmt = q.cfg.model.quantization.format
  assert any(p.endswith("ffn/experts/gate_up") for p in packed)
  assert not any("router" in p or "lm_head" in p or "embed" in p for p in packed)
  if fmt == "fp8_block":  # DeepSeek-V3.2: every linear but the indexer's head weights
    assert any(p.endswith("mixer/q_a_proj/kernel") for p in packed)
    assert any(p.endswith("ffn/shared/gate_up/kernel") for p in packed)
    assert not any(p.endswith("weights_proj/kernel") for p in packed)
  elif fmt == "mxfp4":  # Kimi K3: the routed experts only
    assert all("/ffn/experts/" in p for p in packed)
  else:  # the house model, ignoring attention and shared experts as K2-Thinking does
    assert not any("/mixer/" in p or "/shared/" in p for p in packed)
    assert any(p.endswith("ffn/mlp/gate_up/kernel") for p in packed)


def test_loading_keeps_the_codes_bit_exact(quantized):
  q, _, frozen = quantized
  loaded = hf_weights.flat_paths(frozen)
  abstract = hf_weights.flat_paths(q.frozen_packed)
  assert q.codes and set(q.codes) == {p for p, v in loaded.items() if is_packed(v)}
  for path, value in loaded.items():
    want = abstract[path]
    if path in q.codes:
      codes, scales = q.codes[path]
      assert value.format == want.format and value.shape == want.shape
      for got, exp, spec in ((value.codes, codes, want.codes), (value.scales, scales, want.scales)):
        assert got.sharding == spec.sharding and got.dtype == exp.dtype
        host = np.asarray(got)
        assert host.shape == exp.shape and host.tobytes() == exp.tobytes(), path
    else:
      assert value.sharding == want.sharding
      np.testing.assert_array_equal(np.asarray(value), q.values[path], err_msg=str(path))


def test_packed_slices_are_read_alone(quantized, monkeypatch):
  """Every codes and scales element is read exactly once (devices holding the same slice
  share a read), in blocks smaller than the tensor where the codes are sharded."""
  q, folder, _ = quantized
  reads = {}
  original = hf_weights.CheckpointFiles.read

  def spy(self, tensor, index):
    block = original(self, tensor, index)
    reads.setdefault(tensor, []).append(block.size)
    return block

  monkeypatch.setattr(hf_weights.CheckpointFiles, "read", spy)
  hf_weights.load(folder, q.cfg, q.frozen_packed)
  tensors = qh.raw_tensors(folder)
  packed = [n for n in tensors if n.endswith(("weight_scale_inv", "weight_packed", "weight_scale"))]
  if q.cfg.model.quantization.format == "fp8_block":
    packed += [n[:-len("_scale_inv")] for n in packed]
  assert packed
  for name in packed:
    assert sum(reads[name]) == np.prod(tensors[name][1]), name
  assert any(max(reads[n]) < np.prod(tensors[n][1]) for n in packed if "scale" not in n)


def test_writing_back_is_byte_exact(quantized, tmp_path):
  q, folder, frozen = quantized
  hf_weights.save(tmp_path / "out", q.cfg, frozen, max_shard_bytes=200_000)
  want, got = qh.raw_tensors(folder), qh.raw_tensors(tmp_path / "out")
  assert set(got) == set(want)
  for name in want:
    assert got[name] == want[name], name
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert families.architecture(config, q.cfg.model).quantization == q.cfg.model.quantization


def test_the_bf16_twin_holds_the_dequantized_base(quantized, bases):
  """The twin of the end-to-end test (tests/test_quantized_training.py) is the packed base's
  own dequantized values, every other tensor the same."""
  q, _, frozen = quantized
  twin_folder = bases(q.cfg.model.quantization.format)[2]
  twin, _ = hf_weights.load(twin_folder, qh.bf16_twin(q.cfg), q.frozen_bf16)
  twin = hf_weights.flat_paths(twin)
  for path, value in hf_weights.flat_paths(frozen).items():
    if is_packed(value):  # on the host: one small eager program, not a sharded one per leaf
      value = dataclasses.replace(value, codes=np.asarray(value.codes),
                                  scales=np.asarray(value.scales)).dequantize()
    want = value
    np.testing.assert_array_equal(np.asarray(twin[path]), np.asarray(want), err_msg=str(path))


def test_peft_export_of_a_packed_base_equals_the_bf16_twin(quantized, bases):
  q, folder, frozen = quantized
  twin_folder = bases(q.cfg.model.quantization.format)[2]
  twin_cfg = qh.bf16_twin(q.cfg)
  twin, _ = hf_weights.load(twin_folder, twin_cfg, q.frozen_bf16)
  a = dict(peft_export.adapter_tensors(q.cfg, frozen, q.lora))
  b = dict(peft_export.adapter_tensors(twin_cfg, twin, q.lora))
  assert a and set(a) == set(b)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name])


def test_merge_is_refused_without_the_bf16_option(quantized, tmp_path):
  q, _, frozen = quantized
  with pytest.raises(ConfigError) as info:
    peft_export.export(tmp_path / "adapter", q.cfg, frozen, q.lora, merge=True)
  assert "merge_dequantized" in str(info.value) and "\n" not in str(info.value)
  assert not (tmp_path / "adapter").exists()  # refused before anything is written


def test_merge_dequantized_writes_the_bf16_copy(quantized, tmp_path, capsys):
  q, _, frozen = quantized
  out = tmp_path / "adapter"
  peft_export.export(out, q.cfg, frozen, q.lora, merge=True, merge_dequantized=True)
  said = capsys.readouterr().out
  size = hf_weights.merged_bytes(q.cfg, frozen, q.lora)
  assert f"{size / 1e9:.2f} GB" in said
  merged = qh.raw_tensors(out / "merged")
  assert sum(len(b) for _, _, b in merged.values()) == size
  assert not any(
      n.endswith(("weight_packed", "weight_scale", "weight_scale_inv", "weight_shape"))
      for n in merged)
  config = json.loads((out / "merged" / "config.json").read_text())
  twin_cfg = qh.bf16_twin(q.cfg)
  assert families.architecture(config, q.cfg.model).quantization == QuantizationConfig()
  # the merged weights: the dequantized base plus the adapters' product
  reloaded, _ = hf_weights.load(out / "merged", twin_cfg, q.frozen_bf16)
  reloaded = hf_weights.flat_paths(reloaded)
  adapters = hf_weights.flat_paths(q.lora)
  leaves = {leaf.path: leaf for leaf in plan(q.cfg, frozen)}
  checked = 0
  for path, (codes, scales) in q.codes.items():
    leaf = leaves[path]
    pair = hf_weights.adapter_paths(leaf)
    base = np.asarray(PackedWeight(codes, scales, leaf.packed, *_in_out(leaf)).dequantize())
    want = base.astype(np.float32)
    if pair and pair[0] in adapters:
      a, b = (np.asarray(adapters[p], np.float32) for p in pair)
      n_in = leaf.tensor.in_dims
      if a.ndim < leaf.stack_dims + n_in + 1:  # A shared by the experts
        a = np.expand_dims(a, leaf.stack_dims - 1)
      flat_a = a.reshape(*a.shape[:leaf.stack_dims], -1, a.shape[-1])
      flat_b = b.reshape(*b.shape[:leaf.stack_dims + 1], -1)
      delta = q.cfg.lora.scale * np.matmul(flat_a, flat_b)
      want = want + delta.reshape(want.shape)
      checked += 1
    # bf16 rounding of sums formed in another order: within one bf16 step
    np.testing.assert_allclose(
        np.asarray(reloaded[path]).astype(np.float32), want, rtol=1e-2, atol=1e-6,
        err_msg=str(path))
  assert checked


def _in_out(leaf):
  item = leaf.item_shape
  return tuple(item[:leaf.tensor.in_dims]), tuple(item[leaf.tensor.in_dims:])


# ---- bad folders -----------------------------------------------------------------------


def _first_packed(folder, suffix):
  return next(n for n in qh.raw_tensors(folder) if n.endswith("." + suffix) and "experts" in n)


def _edit(folder, change):
  path = folder / "model.safetensors"
  raw = qh.raw_tensors(folder)
  tensors = {}
  for name, (dtype, shape, data) in raw.items():
    tensors[name] = np.frombuffer(data, _NP[dtype]).reshape(shape)
  change(tensors)
  save_file(tensors, str(path))


_NP = {
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "BF16": ml_dtypes.bfloat16,
    "F32": np.float32,
    "U8": np.uint8,
    "I32": np.int32,
    "I64": np.int64
}


@pytest.mark.parametrize("fmt, case, words", [
    ("fp8_block", "missing_scale", ["weight_scale_inv", "is missing", "fp8_block scales"]),
    ("mxfp4", "missing_scale", ["weight_scale", "is missing", "mxfp4 scales"]),
    ("int4", "scale_shape", ["weight_scale", "shape", "expected", "int4 scales"]),
    ("fp8_block", "scale_dtype", ["weight_scale_inv", "dtype BF16, expected F32"]),
    ("int4", "weight_shape", ["weight_shape", "says", "weight_packed"]),
    ("mxfp4", "codes_shape", ["weight_packed", "shape", "mxfp4 codes"]),
    ("int4", "stored_bf16", ["stored as BF16", "packs it", "weight_packed"]),
    ("fp8_block", "stored_bf16", ["stored as BF16", "packs it"]),
    ("fp8_block", "quantized_where_bf16", ["weights_proj", "stored quantized", "bf16"]),
    ("mxfp4", "quantized_where_bf16", ["shared_experts", "stored quantized", "bf16"]),
    ("mxfp4", "unknown_format", ["quantization_config.format", "'int8-quantized'", "supported"]),
    ("fp8_block", "unknown_method", ["quantization_config.quant_method", "'gptq'", "supported"]),
])
def test_bad_quantized_folders_are_one_line_errors(bases, tmp_path, fmt, case, words):
  q, base, _ = bases(fmt)
  folder = Path(shutil.copytree(base, tmp_path / "base"))
  if case == "missing_scale":
    _edit(folder, lambda t: t.pop(_first_packed(folder, words[0])))
  elif case == "scale_shape":
    name = _first_packed(folder, "weight_scale")
    _edit(folder, lambda t: t.update({name: t[name][:, :-1].copy()}))
  elif case == "scale_dtype":
    name = _first_packed(folder, "weight_scale_inv")
    _edit(folder, lambda t: t.update({name: t[name].astype(ml_dtypes.bfloat16)}))
  elif case == "weight_shape":
    name = _first_packed(folder, "weight_shape")
    _edit(folder, lambda t: t.update({name: t[name] + np.array([0, 8], np.int32)}))
  elif case == "codes_shape":
    name = _first_packed(folder, "weight_packed")
    _edit(folder, lambda t: t.update({name: t[name][:-1].copy()}))
  elif case == "stored_bf16":
    suffix = "weight_scale_inv" if fmt == "fp8_block" else "weight_scale"
    scale = _first_packed(folder, suffix)
    base = scale.rsplit(".", 1)[0]

    def unpack(t):
      for n in [n for n in t if n.startswith(base + ".")]:
        t.pop(n)
      out_n, in_k = _shape_of(q, base)
      t[base + ".weight"] = np.zeros((out_n, in_k), ml_dtypes.bfloat16)

    _edit(folder, unpack)
  elif case == "quantized_where_bf16":
    name = next(n for n in qh.raw_tensors(folder) if words[0] in n and n.endswith(".weight"))
    base = name[:-len(".weight")]

    def pack(t):
      matrix = t.pop(name).astype(np.float32)
      codes, scales = qh.quantized_matrices(fmt, [matrix])[0]
      t.update(qh.shipped_tensors(fmt, name, codes, scales, matrix.shape))

    _edit(folder, pack)
  elif case in ("unknown_format", "unknown_method"):
    config = json.loads((folder / "config.json").read_text())
    section = config.get("text_config", config)["quantization_config"]
    section.update({"format": "int8-quantized"} if case ==
                   "unknown_format" else {"quant_method": "gptq"})
    (folder / "config.json").write_text(json.dumps(config))
  error = ConfigError if case.startswith("unknown") else WeightsError
  with pytest.raises(error) as info:
    hf_weights.load(folder, q.cfg, q.frozen_packed)
  message = str(info.value)
  assert "\n" not in message
  for word in words:
    assert word in message, message
  if error is WeightsError:
    assert "model.safetensors" in message or str(folder) in message


def _shape_of(q, module):
  for leaf in plan(q.cfg, q.frozen_bf16):
    for _, names in leaf.items():
      if module + ".weight" in names:
        return leaf.tensor_shape()
  raise KeyError(module)


@pytest.mark.parametrize("quantized", ["int4"], indirect=True)  # the house model's folder
def test_the_command_refuses_a_merge_of_a_packed_base_before_training(quantized, tmp_path, capsys):
  _, folder, _ = quantized
  from experiments import lora_2p8t
  common = ["--preset", "tiny", "--base-weights", str(folder), "--out", str(tmp_path / "run")]
  rc = lora_2p8t.main(common + ["--export-adapter", str(tmp_path / "adapter"), "--merge"])
  err = capsys.readouterr().err.strip()
  assert rc == 2 and "\n" not in err and "int4" in err and "--merge-dequantized" in err
  assert lora_2p8t.main(common + ["--merge-dequantized"]) == 2
  assert "goes with --merge" in capsys.readouterr().err
  assert not (tmp_path / "run").exists()


# ---- checkpoints written by compressed-tensors -----------------------------------------

QUANT_FIXTURES = Path(__file__).parent / "fixtures" / "quant"


@pytest.mark.parametrize("case", ["deepseek_v32_int4", "kimi_k3_mxfp4"])
def test_checkpoints_written_by_compressed_tensors(case, tmp_path):
  """Folders quantized and compressed by compressed-tensors itself
  (experiments/quant_fixtures.py): read as the library wrote them, our dequantized weights
  are the library's own decompression, and they are written back as they came."""
  folder = QUANT_FIXTURES / case
  cfg = qh.released_config(families.read_config(folder))
  cfg = dataclasses.replace(
      cfg, checkpoint=dataclasses.replace(cfg.checkpoint, base_weights=str(folder)))
  assert cfg.model.quantization.format == {"deepseek_v32_int4": "int4"}.get(case, "mxfp4")
  from hylora.train import state as st
  from meshes.mesh import build_mesh
  mesh = build_mesh(cfg.mesh)
  _, frozen_bf16 = st.abstract_arrays(st.model_parts(qh.bf16_twin(cfg)), mesh)
  frozen, _ = hf_weights.load(folder, cfg, qh.packed_abstract(cfg, mesh, frozen_bf16))
  reference = load_file(str(folder / "reference" / "decompressed.safetensors"))
  flat, compared = hf_weights.flat_paths(frozen), 0
  for leaf in plan(cfg, frozen):
    if not leaf.packed:
      continue
    value = flat[leaf.path]
    weight = dataclasses.replace(value, codes=np.asarray(value.codes),
                                 scales=np.asarray(value.scales)).dequantize()
    weight = np.asarray(weight)
    for index, names in leaf.items():
      for name, tensor in zip(names, hf_weights.to_tensors(leaf, weight[index])):
        np.testing.assert_array_equal(tensor, reference[name], err_msg=name)
        compared += 1
  assert compared == len(reference) > 0
  hf_weights.save(tmp_path / "out", cfg, frozen)
  want, got = qh.raw_tensors(folder), qh.raw_tensors(tmp_path / "out")
  assert set(got) == set(want)
  for name, (dtype, shape, data) in want.items():
    if name.endswith(".weight_shape"):  # compressed-tensors writes int64, we write int32
      assert got[name][1] == shape and np.array_equal(
          np.frombuffer(got[name][2], _NP[got[name][0]]), np.frombuffer(data, _NP[dtype]))
    else:
      assert got[name] == want[name], name

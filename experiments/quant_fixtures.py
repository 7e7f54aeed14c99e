"""Reference fixtures from compressed-tensors, the library Kimi K2-Thinking's INT4 and Kimi
K3's MXFP4 weights are written with: tiny random checkpoints quantized and compressed by
the library's own `apply_quantization_config` and `ModelCompressor.compress_model`, with
the weights its own decompression gives back.

  python -m experiments.quant_fixtures bf16 --out tests/fixtures/quant   # this stack's venv
  pip install '.[quant-fixtures]'                                      # another venv (torch)
  python experiments/quant_fixtures.py compress --out tests/fixtures/quant

`bf16` writes each case's random bf16 checkpoint (`<out>/<case>/bf16/`, this stack's
writer); `compress` replaces it with `<out>/<case>/`: config.json with the library's
`quantization_config`, model.safetensors with its compressed tensors, and
reference/decompressed.safetensors with every packed module's weight (`<module>.weight`,
bf16) as the library decompresses it. Cases:

  deepseek_v32_int4  DeepSeek-V3.2's layout, pack-quantized INT4 (4-bit symmetric int,
                     group 32) with K2-Thinking's ignore list: routed experts only
  kimi_k3_mxfp4      Kimi K3's layout, mxfp4-pack-quantized routed experts with the
                     published K3 config's ignore list

Every Linear module not ignored is quantized (the router and embeddings are not Linear
modules in these families' code); the weight scales are the library's own min-max
scales (`compute_dynamic_scales_and_zp`), as its weight observer computes them.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HF_FIXTURES = ROOT / "tests" / "fixtures" / "hf"
SEED = 0
K2_THINKING_IGNORE = [
    "lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"
]


def case_configs() -> dict[str, dict]:
  """case -> (config.json without quantization, compressed-tensors format, ignore)."""
  deepseek = json.loads((HF_FIXTURES / "deepseek_v32" / "config.json").read_text())
  kimi = json.loads((HF_FIXTURES / "kimi_linear" / "config.json").read_text())
  kimi["linear_attn_config"] = dict(kimi["linear_attn_config"], gate_lower_bound=-5.0,
                                    use_full_rank_gate=True)
  kimi.pop("layer_types", None)
  kimi.update(q_lora_rank=24, mla_use_output_gate=True, routed_expert_hidden_size=64,
              hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
              attn_res_block_size=2, num_shared_experts=2)
  k3_config = json.loads(
      (ROOT / "src" / "hylora" / "core" / "families" / "configs" / "kimi-k3.json").read_text())
  k3_ignore = k3_config["text_config"]["quantization_config"]["ignore"]
  return {
      "deepseek_v32_int4": (deepseek, "pack-quantized", K2_THINKING_IGNORE),
      "kimi_k3_mxfp4": ({
          "model_type": "kimi_k3",
          "architectures": ["KimiK3ForConditionalGeneration"],
          "text_config": kimi
      }, "mxfp4-pack-quantized", k3_ignore),
  }


# ---- step 1: random bf16 checkpoints (this stack) ---------------------------------------


def write_bf16(out: Path) -> None:
  import dataclasses

  import jax
  import numpy as np

  from hylora.core import families
  from hylora.core.config import MeshConfig
  from hylora.core.presets import tiny
  from hylora.io import hf_weights
  from hylora.train import state as st
  from meshes.mesh import build_mesh

  rng = np.random.default_rng(SEED)
  for case, (hf, _, _) in case_configs().items():
    cfg = tiny()
    cfg = dataclasses.replace(cfg, model=families.architecture(hf, cfg.model),
                              mesh=MeshConfig(fsdp=1, expert=1, devices=1))
    mesh = build_mesh(cfg.mesh)
    _, frozen = st.abstract_arrays(st.model_parts(cfg), mesh)

    def draw(x):
      if np.issubdtype(x.dtype, np.integer):
        value = np.broadcast_to(np.arange(x.shape[-1]), x.shape).astype(x.dtype)
      else:
        value = (rng.standard_normal(x.shape) * 0.05).astype(x.dtype)
      return jax.device_put(value, x.sharding)

    folder = out / case / "bf16"
    hf_weights.save(folder, cfg, jax.tree.map(draw, frozen))
    (folder / "config.json").write_text(json.dumps(hf, indent=1) + "\n")
    print(f"{case}: bf16 checkpoint in {folder}")


# ---- step 2: compressed-tensors (torch) -------------------------------------------------


def _module_tree(tensors: dict):
  """A torch module tree with the checkpoint's names: every 2-D `<m>.weight` of a Linear
  module becomes an nn.Linear (not the router `gate` nor the embeddings), every other
  tensor a parameter of its module."""
  import torch

  root = torch.nn.Module()

  def owner(path: list[str]):
    module = root
    for part in path:
      if not hasattr(module, part):
        module.add_module(part, torch.nn.Module())
      module = getattr(module, part)
    return module

  for name, value in tensors.items():
    *path, leaf = name.split(".")
    linear = (leaf == "weight" and value.ndim == 2 and path[-1] not in ("gate", "embed_tokens"))
    if linear:
      parent = owner(path[:-1])
      layer = torch.nn.Linear(value.shape[1], value.shape[0], bias=False, dtype=value.dtype)
      layer.weight.data.copy_(value)
      parent.add_module(path[-1], layer)
    else:
      owner(path).register_parameter(leaf, torch.nn.Parameter(value, requires_grad=False))
  return root


def compress(out: Path) -> None:
  import torch
  from compressed_tensors.compressors import ModelCompressor
  from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                               QuantizationScheme, apply_quantization_config)
  from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
  from safetensors.torch import load_file, save_file

  for case, (_, fmt, ignore) in case_configs().items():
    source = out / case / "bf16"
    hf = json.loads((source / "config.json").read_text())
    tensors = {}
    for path in sorted(source.glob("*.safetensors")):
      tensors.update(load_file(str(path)))
    model = _module_tree(tensors)
    weights = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32,
                               symmetric=True, dynamic=False)
    if fmt == "mxfp4-pack-quantized":
      weights = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32,
                                 symmetric=True, dynamic=False, scale_dtype=torch.uint8,
                                 zp_dtype=torch.uint8)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        ignore=ignore, format=fmt)
    apply_quantization_config(model, config)
    quantized = {n: m for n, m in model.named_modules() if hasattr(m, "quantization_scheme")}
    for module in quantized.values():
      scale, zero = compute_dynamic_scales_and_zp(module.weight, module.quantization_scheme.weights,
                                                  module)
      module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
      if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    state = {n: t.contiguous() for n, t in model.state_dict().items()}
    target = out / case
    (target / "config.json").write_text(json.dumps(hf, indent=1) + "\n")
    compressor.update_config(str(target))  # while the config says "compressed"
    compressor.decompress_model(model)
    reference = {
        f"{n}.weight": m.weight.data.to(torch.bfloat16).contiguous() for n, m in quantized.items()
    }
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "reference").mkdir(exist_ok=True)
    save_file(reference, str(target / "reference" / "decompressed.safetensors"),
              metadata={"format": "pt"})
    if "text_config" in hf:  # K3 keeps its quantization_config in the text config
      written = json.loads((target / "config.json").read_text())
      written["text_config"]["quantization_config"] = written.pop("quantization_config")
      (target / "config.json").write_text(json.dumps(written, indent=1, sort_keys=True) + "\n")
    shutil.rmtree(source)
    print(f"{case}: {len(quantized)} modules packed ({fmt}) in {target}")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("step", choices=("bf16", "compress"))
  p.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "quant"))
  args = p.parse_args(argv)
  (write_bf16 if args.step == "bf16" else compress)(Path(args.out))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

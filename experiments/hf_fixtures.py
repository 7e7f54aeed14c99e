"""Reference fixtures from Hugging Face transformers: tiny random checkpoints of the
released families, saved with transformers' own `save_pretrained` in the released tensor
layout, and their fp32 logits from transformers' own forward.

  pip install torch transformers==5.23.0 peft      # the `hf-fixtures` extra
  python -m experiments.hf_fixtures --out tests/fixtures/hf

For every family: `<out>/<family>/` holds config.json, model.safetensors, input_ids.npy
[B, T] and logits.npy [B, T, V] (fp32). Every parameter is drawn at random (norms around 1,
router biases non-zero) so that each one moves the logits. The configurations exercise
every block of the family: Kimi Linear has MLA layers between KDA layers and as the last
layer, a dense first layer, shared experts, sequences longer than one 64-token chunk;
DeepSeek-V3.2 has group-limited routing (4 groups, 2 kept), YaRN RoPE and an indexer
top-k smaller than the sequence, with no tie at any query's top-k boundary.

With `--adapter DIR --expect LOGITS.npy` it instead loads `<family>`'s base with the PEFT
adapter in DIR and checks transformers' logits against ours.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

SEED = 0
MAX_REL_ERR = 1e-4


def _configs():
  from transformers import DeepseekV32Config, KimiLinearConfig
  kimi = KimiLinearConfig(
      vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
      num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
      q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8,
      num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.446,
      first_k_dense_replace=1, rms_norm_eps=1e-5, linear_attn_config={
          "full_attn_layers": [3, 5],
          "kda_layers": [1, 2, 4],
          "head_dim": 16,
          "num_heads": 2,
          "short_conv_kernel_size": 4
      }, pad_token_id=0, bos_token_id=1, eos_token_id=2)
  deepseek = DeepseekV32Config(
      vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
      num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=24,
      kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
      num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
      first_k_dense_replace=1, index_n_heads=8, index_head_dim=16, index_topk=16, rms_norm_eps=1e-6,
      rope_parameters={
          "rope_type": "yarn",
          "rope_theta": 10000.0,
          "factor": 4.0,
          "original_max_position_embeddings": 32,
          "beta_fast": 32.0,
          "beta_slow": 1.0,
          "mscale": 1.0,
          "mscale_all_dim": 1.0
      }, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
  return {"kimi_linear": (kimi, (2, 80)), "deepseek_v32": (deepseek, (2, 40))}


def _randomize(model, torch, seed: int):
  """Every parameter and buffer at random: norms near 1, the rest small."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
      if not p.is_floating_point() or "inv_freq" in name:
        continue
      noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
      if name.endswith("norm.weight") or "layernorm" in name or "k_norm.weight" in name:
        p.copy_(1.0 + 0.1 * noise)
      elif name.endswith("A_log"):
        p.copy_(torch.log(torch.rand(p.shape, generator=g) * 15 + 1))
      elif "e_score_correction_bias" in name:
        p.copy_(0.05 * noise)
      elif name.endswith("dt_bias"):  # the released init: softplus(dt_bias) in (1e-3, 0.1)
        dt = torch.exp(
            torch.rand(p.shape, generator=g) * (np.log(0.1) - np.log(1e-3)) + np.log(1e-3))
        p.copy_(dt + torch.log(-torch.expm1(-dt)))
      elif name.endswith(".bias"):
        p.copy_(0.1 * noise)
      else:
        fan_in = p.shape[-1] if p.ndim >= 2 else 1
        p.copy_(noise / fan_in**0.5)


def _indexer_margins(model, ids, torch):
  """The smallest gap between each query's k-th and (k+1)-th indexer score, over layers:
  a tie there would let two correct implementations pick different keys."""
  gaps = []

  def hook(module, args, kwargs):
    hidden, q_resid, (cos, sin), mask = args[:4]
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb
    b, s, _ = hidden.shape
    q = module.wq_b(q_resid).view(b, s, module.n_heads, module.head_dim)
    r = module.qk_rope_head_dim
    k = module.k_norm(module.wk(hidden)).unsqueeze(2)
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., r:]], -1)
    k = torch.cat([k_rot, k[..., r:]], -1).squeeze(2)
    scores = torch.relu(q @ k.transpose(-1, -2).unsqueeze(1) * module.softmax_scale)
    w = module.weights_proj(hidden) * module.n_heads**-0.5
    index = (w.unsqueeze(-2) @ scores).squeeze(-2)
    index = index.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else index + mask
    for t in range(module.index_topk, s):  # queries with more causal keys than k
      top = torch.topk(index[:, t, :t + 1], module.index_topk + 1, dim=-1).values
      gaps.append(float((top[:, -2] - top[:, -1]).min()))

  handles = [
      m.register_forward_pre_hook(hook, with_kwargs=True)
      for n, m in model.named_modules()
      if n.endswith("indexer")
  ]
  with torch.no_grad():
    model(input_ids=ids)
  for h in handles:
    h.remove()
  return min(gaps) if gaps else float("inf")


def _released_layout(folder: Path, family: str):
  """transformers 5.23 writes Kimi Linear's dense first-layer MLP under the MoE module's
  name (`block_sparse_moe.gate_proj`); the released checkpoints keep it under `mlp.`."""
  if family != "kimi_linear":
    return
  from safetensors.numpy import load_file, save_file
  path = folder / "model.safetensors"
  tensors = load_file(str(path))
  renamed = {}
  for name, array in tensors.items():
    for proj in ("gate_proj", "up_proj", "down_proj"):
      if name.endswith(f".block_sparse_moe.{proj}.weight"):
        name = name.replace(f".block_sparse_moe.{proj}.", f".mlp.{proj}.")
    renamed[name] = array
  save_file(renamed, str(path), metadata={"format": "pt"})


def make(out: Path):
  import torch
  from transformers import AutoModelForCausalLM
  torch.manual_seed(SEED)
  for family, (config, (batch, length)) in _configs().items():
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).float().eval()
    for seed in range(SEED, SEED + 50):  # inputs with no near-tie at an indexer boundary
      _randomize(model, torch, seed)
      ids = torch.randint(3, config.vocab_size, (batch, length),
                          generator=torch.Generator().manual_seed(seed + 1))
      if family != "deepseek_v32" or _indexer_margins(model, ids, torch) > 1e-4:
        break
    else:
      raise SystemExit(f"{family}: every seed puts a near-tie at an indexer top-k boundary")
    with torch.no_grad():
      logits = model(input_ids=ids).logits.float().numpy()
    folder = out / family
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    _released_layout(folder, family)
    # The fixture must be a checkpoint transformers itself loads to the same logits.
    again = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float()
    with torch.no_grad():
      reloaded = again(input_ids=ids).logits.float().numpy()
    err = np.abs(reloaded - logits).max()
    assert err <= 1e-6 * np.abs(logits).max(), f"{family}: reloading changed the logits ({err})"
    np.save(folder / "input_ids.npy", ids.numpy().astype(np.int32))
    np.save(folder / "logits.npy", logits.astype(np.float32))
    print(f"{family}: {folder} logits {logits.shape}, max |logit| {np.abs(logits).max():.3f}")


def check_adapter(base: Path, adapter: Path, expect: Path, ids: Path) -> float:
  """Relative max error of transformers + PEFT against our adapted logits."""
  import torch
  from peft import PeftModel
  from transformers import AutoModelForCausalLM
  model = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager").float()
  model = PeftModel.from_pretrained(model, adapter).eval()
  with torch.no_grad():
    logits = model(input_ids=torch.from_numpy(np.load(ids)).long()).logits.float().numpy()
  want = np.load(expect)
  return float(np.abs(logits - want).max() / np.abs(want).max())


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", type=Path, default=Path("tests/fixtures/hf"))
  p.add_argument("--adapter", type=Path, help="a PEFT adapter folder to check")
  p.add_argument("--base", type=Path, help="with --adapter: the base checkpoint folder")
  p.add_argument("--expect", type=Path, help="with --adapter: our logits (.npy)")
  p.add_argument("--input-ids", type=Path, help="with --adapter: the token ids (.npy)")
  args = p.parse_args(argv)
  if args.adapter:
    err = check_adapter(args.base, args.adapter, args.expect, args.input_ids)
    print(f"PEFT on transformers vs ours: max error {err:.2e} of max |logit|")
    return 0 if err <= MAX_REL_ERR else 1
  make(args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

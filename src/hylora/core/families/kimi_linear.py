"""Kimi Linear and Kimi K3 (`model_type` "kimi_linear", and "kimi_k3" whose
`text_config` is a kimi_linear config): KDA layers and MLA layers listed (1-based) in
`linear_attn_config`, a dense first layer, sigmoid-routed MoE with shared experts; K3
adds a full-rank KDA output gate, a decay lower bound, gated MLA, latent MoE, SiTU-GLU
and block attention residuals. K3's vision tower (MoonViT) is not this stack's: the text
model loads without it."""

from __future__ import annotations

import dataclasses

from hylora.core.config import KDAConfig, MLAConfig, ModelConfig
from hylora.core.families._fields import field, mla_heads, require
from hylora.core.families._quantization import quantization


def _text(hf: dict) -> dict:
  return hf["text_config"] if hf.get("model_type") == "kimi_k3" else hf


def layer_types(hf: dict) -> tuple[str, ...]:
  """The mixer of every layer ("kda" or "mla"), from the 1-based lists in
  `linear_attn_config` or an explicit `layer_types`."""
  n = field(hf, "num_hidden_layers")
  lac = hf.get("linear_attn_config") or {}
  if "full_attn_layers" in lac and "kda_layers" in lac:
    kinds = [None] * n
    for layer in lac["full_attn_layers"]:
      require(
          1 <= layer <= n, hf, f"linear_attn_config.full_attn_layers has {layer}, "
          f"outside 1..{n} (the lists are 1-based)")
      kinds[layer - 1] = "mla"
    for layer in lac["kda_layers"]:
      require(1 <= layer <= n, hf, f"linear_attn_config.kda_layers has {layer}, outside 1..{n}")
      kinds[layer - 1] = "kda"
    unset = [i + 1 for i, k in enumerate(kinds) if k is None]
    require(not unset, hf, f"layers {unset} are in neither kda_layers nor full_attn_layers")
    return tuple(kinds)
  if hf.get("layer_types"):
    names = {"linear_attention": "kda", "full_attention": "mla"}
    require(all(t in names for t in hf["layer_types"]), hf,
            f"layer_types must be linear_attention / full_attention, got {hf['layer_types']}")
    return tuple(names[t] for t in hf["layer_types"])
  return tuple("mla" if i and i % 4 == 0 else "kda" for i in range(n))


def architecture(hf: dict, model: ModelConfig) -> ModelConfig:
  family = "kimi_k3" if hf.get("model_type") == "kimi_k3" else "kimi_linear"
  outer, hf = hf, _text(hf)
  lac = hf.get("linear_attn_config") or {}
  heads = mla_heads(hf)
  act = field(hf, "hidden_act", default="silu")
  require(act in ("silu", "situ"), hf, f"hidden_act {act!r}: supported silu, situ")
  k_dim = field(lac, "head_dim", default=field(hf, "linear_head_dim", default=128))
  lower = lac.get("gate_lower_bound", hf.get("forget_gate_lower_bound"))
  full_gate = lac.get("use_full_rank_gate", hf.get("use_full_rank_output_gate", False))
  kda = KDAConfig(
      **{
          "heads":
              field(lac, "num_heads", default=field(hf, "linear_num_heads", default=32)),
          "head_dim":
              k_dim,
          "conv_size":
              field(lac, "short_conv_kernel_size", default=field(hf, "linear_conv_kernel_dim",
                                                                 default=4)),
          "gate_rank":
              k_dim,  # f_a: hidden -> head_dim
          "output_gate_rank":
              0 if full_gate else k_dim,
          "gate_lower_bound":
              float(lower) if lower is not None else 0.0,
      })
  mla = MLAConfig(
      **{
          "heads": heads,
          "q_rank": field(hf, "q_lora_rank", default=0),
          "kv_rank": field(hf, "kv_lora_rank"),
          "nope_dim": field(hf, "qk_nope_head_dim"),
          "rope_dim": field(hf, "qk_rope_head_dim"),
          "v_dim": field(hf, "v_head_dim"),
          "rope": False,  # Kimi's MLA is NoPE
          "output_gate": bool(hf.get("mla_use_output_gate", False)),
          "block_q": model.mla.block_q,
          "block_k": model.mla.block_k,
      })
  router = field(hf, "moe_router_activation_func", "scoring_func", default="sigmoid")
  require(router in ("sigmoid", "softmax"), hf, f"router activation {router!r}")
  latent = field(hf, "routed_expert_hidden_size", default=0)
  moe = dataclasses.replace(
      model.moe, **{
          "experts": field(hf, "num_experts", "num_local_experts"),
          "top_k": field(hf, "num_experts_per_token", "num_experts_per_tok"),
          "expert_ffn": field(hf, "moe_intermediate_size"),
          "shared_experts": field(hf, "num_shared_experts", "n_shared_experts", default=0),
          "score_fn": router,
          "normalize_top_k": bool(field(hf, "moe_renormalize", "norm_topk_prob", default=True)),
          "routed_scale": float(field(hf, "routed_scaling_factor", default=1.0)),
          "groups": field(hf, "num_expert_group", "n_group", default=1),
          "groups_kept": field(hf, "topk_group", default=1),
          "latent_dim": latent,
      })
  block = field(hf, "attn_res_block_size", default=0)
  kinds = layer_types(hf)
  return dataclasses.replace(
      model,
      **{
          "family": family,
          "vocab_size": field(hf, "vocab_size"),
          "d_model": field(hf, "hidden_size"),
          "layers": len(kinds),
          "pattern": ("kda", "kda", "kda", "mla"),
          "layer_types": kinds,
          "dense_layers": field(hf, "first_k_dense_replace", default=1),
          "dense_ffn": field(hf, "intermediate_size"),
          "ffn": "latent_moe" if latent else "moe",
          "activation": act,
          "situ_beta": float(field(hf, "activation_situ_beta", default=4.0)),
          # null: SiTU leaves `up` unbounded (0 here)
          "situ_linear_beta": float(hf.get("activation_situ_linear_beta", 25.0) or 0.0),
          "residual": "block_attention" if block else "add",
          "residual_block": block or model.residual_block,
          "norm_eps": float(field(hf, "rms_norm_eps", default=1e-5)),
          "kda": kda,
          "mla": mla,
          "moe": moe,
          "vision": dataclasses.replace(model.vision, enabled=False),
          # K3 keeps it in text_config; a copy at the top level counts too
          "quantization": quantization(hf if "quantization_config" in hf else outer),
      })


def ignored_tensors(hf: dict) -> tuple[str, ...]:
  if hf.get("model_type") == "kimi_k3":
    return (r"^(vision_tower|mm_projector)\.",)
  return ()

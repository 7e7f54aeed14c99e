"""DeepSeek-V3.2 (`model_type` "deepseek_v32"): MLA with low-rank q, YaRN RoPE and the
top-k sparse-attention indexer in every layer, `first_k_dense_replace` dense layers,
group-limited sigmoid routing; multi-token-prediction layers past the model's last."""

from __future__ import annotations

import dataclasses

from hylora.core.config import MLAConfig, ModelConfig
from hylora.core.families._fields import field, mla_heads, require
from hylora.core.families._quantization import quantization

# Linears DeepSeek-V3.2 ships in bf16 although its config names none: the indexer's head
# weights (the router, norms, embeddings and lm_head are never packed).
UNQUANTIZED = ("re:.*indexer\\.weights_proj$",)


def _rope(hf: dict) -> dict:
  rope = dict(hf.get("rope_parameters") or {})
  rope.update(hf.get("rope_scaling") or {})
  rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
  kind = rope.get("rope_type", rope.get("type", "default"))
  require(kind in ("default", "yarn"), hf, f"rope type {kind!r}: supported default, yarn")
  rope["rope_type"] = kind
  return rope


def architecture(hf: dict, model: ModelConfig) -> ModelConfig:
  heads = mla_heads(hf)
  require(field(hf, "hidden_act", default="silu") == "silu", hf, "hidden_act must be silu")
  rope = _rope(hf)
  yarn = rope["rope_type"] == "yarn"
  mla = MLAConfig(
      **{
          "heads": heads,
          "q_rank": field(hf, "q_lora_rank"),
          "kv_rank": field(hf, "kv_lora_rank"),
          "nope_dim": field(hf, "qk_nope_head_dim"),
          "rope_dim": field(hf, "qk_rope_head_dim"),
          "v_dim": field(hf, "v_head_dim"),
          "rope": True,
          "rope_theta": float(rope["rope_theta"]),
          "yarn_factor": float(rope.get("factor", 1.0)) if yarn else 1.0,
          "yarn_original_max_positions": int(rope.get("original_max_position_embeddings", 4096)),
          "yarn_beta_fast": float(rope.get("beta_fast", 32.0)),
          "yarn_beta_slow": float(rope.get("beta_slow", 1.0)),
          "yarn_mscale": float(rope.get("mscale", 1.0)),
          "yarn_mscale_all_dim": float(rope.get("mscale_all_dim", 0.0)),
          "index_topk": field(hf, "index_topk"),
          "index_heads": field(hf, "index_n_heads"),
          "index_head_dim": field(hf, "index_head_dim"),
          "block_q": model.mla.block_q,
          "block_k": model.mla.block_k,
      })
  scoring = field(hf, "scoring_func", default="sigmoid")
  require(scoring in ("sigmoid", "softmax"), hf, f"scoring_func {scoring!r}")
  moe = dataclasses.replace(
      model.moe, **{
          "experts": field(hf, "n_routed_experts"),
          "top_k": field(hf, "num_experts_per_tok"),
          "expert_ffn": field(hf, "moe_intermediate_size"),
          "shared_experts": field(hf, "n_shared_experts", default=0),
          "score_fn": scoring,
          "normalize_top_k": bool(field(hf, "norm_topk_prob", default=True)),
          "routed_scale": float(field(hf, "routed_scaling_factor", default=1.0)),
          "groups": field(hf, "n_group", default=1),
          "groups_kept": field(hf, "topk_group", default=1),
          "latent_dim": 0,
      })
  return dataclasses.replace(
      model, **{
          "family": "deepseek_v32",
          "vocab_size": field(hf, "vocab_size"),
          "d_model": field(hf, "hidden_size"),
          "layers": field(hf, "num_hidden_layers"),
          "pattern": ("mla",),
          "layer_types": (),
          "dense_layers": field(hf, "first_k_dense_replace", default=0),
          "dense_ffn": field(hf, "intermediate_size"),
          "ffn": "moe",
          "activation": "silu",
          "residual": "add",
          "norm_eps": float(field(hf, "rms_norm_eps", default=1e-6)),
          "mla": mla,
          "moe": moe,
          "vision": dataclasses.replace(model.vision, enabled=False),
          "quantization": _quantization(hf),
      })


def _quantization(hf: dict):
  q = quantization(hf)
  if q.format == "none":
    return q
  return dataclasses.replace(q,
                             ignore=q.ignore + tuple(e for e in UNQUANTIZED if e not in q.ignore))


def ignored_tensors(hf: dict) -> tuple[str, ...]:
  """The multi-token-prediction layers (`model.layers.<n>.` for n >= num_hidden_layers)."""
  n, extra = hf.get("num_hidden_layers", 0), hf.get("num_nextn_predict_layers", 0) or 0
  if not extra:
    return ()
  return (r"^model\.layers\.(" + "|".join(str(n + i) for i in range(extra)) + r")\.",)

"""Named configurations: `tiny` (CPU, 8 simulated devices), `gpu-1` (one 141 GB GPU),
`2p8t` (the 2.8T target model, exactly as docs/target_model.md fixes it), and the
released models at full size, read from their published config.json
(`hylora.core.families`): `kimi-linear`, `deepseek-v3.2`, `kimi-k3`."""

from __future__ import annotations

import dataclasses

from hylora.core.config import (Config, LinearAttentionConfig, LoRAConfig, MemoryConfig, MeshConfig,
                                ModelConfig, MoEConfig, SparseAttentionConfig, TrainConfig,
                                VisionConfig)
from hylora.core.errors import ConfigError

_TARGET_LINEAR = LinearAttentionConfig(heads=64, head_dim=128, gate_rank=128, output_gate_rank=128,
                                       delta_rule=True)
_TARGET_SPARSE = SparseAttentionConfig(q_heads=64, kv_heads=8, head_dim=128, top_k=2048,
                                       index_heads=64, index_head_dim=128, index_q_rank=1536,
                                       block_q=512)
_TARGET_LORA = LoRAConfig(rank=16, alpha=32.0)
# ~0.39B: a ViT-L-sized encoder (24 x 1024, patch 14, 336-pixel tiles -> 144 tokens
# per tile after 2x2 merging) and a two-layer projector into d_model.
_TARGET_VISION = VisionConfig(enabled=True, image_size=336, patch_size=14, width=1024, layers=24,
                              heads=16, mlp=4096, merge=2, max_tiles=6, max_image_side=8192)


def tiny() -> Config:
  return Config(
      preset="tiny",
      model=ModelConfig(vocab_size=256, d_model=32, layers=8, dense_layers=1, dense_ffn=64,
                        linear_attention=LinearAttentionConfig(heads=4, head_dim=16),
                        sparse_attention=SparseAttentionConfig(top_k=16),
                        moe=MoEConfig(experts=8, top_k=2, expert_ffn=32),
                        vision=VisionConfig(enabled=True, max_image_side=256)),
      lora=LoRAConfig(rank=4, alpha=8.0),
      mesh=MeshConfig(fsdp=-1, expert=4, devices=8),
      train=TrainConfig(steps=40, batch_size=8, seq_len=128, learning_rate=5e-3),
  )


def gpu_1() -> Config:
  """The target's layer widths on one GPU: 8 layers (L L L S x 2), 32 experts top-8."""
  return Config(
      preset="gpu-1",
      model=ModelConfig(vocab_size=163840, d_model=7168, layers=8, dense_layers=1, dense_ffn=18432,
                        linear_attention=_TARGET_LINEAR, sparse_attention=_TARGET_SPARSE,
                        moe=MoEConfig(experts=32, top_k=8, expert_ffn=2048,
                                      score_fn="sigmoid"), vision=_TARGET_VISION),
      lora=_TARGET_LORA,
      mesh=MeshConfig(fsdp=1, expert=1),
      train=TrainConfig(steps=20, batch_size=2, seq_len=8192, learning_rate=2e-4, warmup_steps=2),
  )


def target_2p8t() -> Config:
  return Config(
      preset="2p8t",
      model=ModelConfig(
          vocab_size=163840, d_model=7168, layers=72, dense_layers=2, dense_ffn=18432,
          linear_attention=_TARGET_LINEAR, sparse_attention=_TARGET_SPARSE,
          moe=MoEConfig(experts=896, top_k=16, expert_ffn=2048, shared_experts=1,
                        score_fn="sigmoid"), vision=_TARGET_VISION),
      lora=_TARGET_LORA,
      mesh=MeshConfig(fsdp=2, expert=64),
      train=TrainConfig(steps=1000, batch_size=64, seq_len=32768, learning_rate=2e-4,
                        warmup_steps=50),
  )


# LoRA on every attention linear and every gated MLP's gate and up projections, named as
# the released checkpoints name their modules (hylora.core.architecture.lora_targets).
RELEASED_LORA = LoRAConfig(
    rank=16, alpha=32.0, targets=("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
                                  "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj"))


def _released(name: str, mesh: MeshConfig, batch_size: int, seq_len: int) -> Config:
  from hylora.core.families import architecture, published
  model = architecture(published(name), ModelConfig(moe=MoEConfig(score_fn="sigmoid")))
  train = TrainConfig(steps=1000, batch_size=batch_size, seq_len=seq_len, learning_rate=2e-4,
                      warmup_steps=50)
  return Config(preset=name, model=model, lora=RELEASED_LORA, mesh=mesh, train=train)


def kimi_linear() -> Config:
  """Kimi-Linear-48B-A3B: 16 GPUs (fsdp 2 x expert 8), 16384 tokens per GPU."""
  return _released("kimi-linear", MeshConfig(fsdp=2, expert=8), 8, 32768)


def deepseek_v32() -> Config:
  """DeepSeek-V3.2 (671B): 128 GPUs (fsdp 2 x expert 64), 16384 tokens per GPU."""
  return _released("deepseek-v3.2", MeshConfig(fsdp=2, expert=64), 64, 32768)


def kimi_k3() -> Config:
  """Kimi K3 (2.8T): 128 GPUs (fsdp 2 x expert 64), 64 rows of 16384 tokens (8192 per GPU,
  1M per step): its 93 layers leave less room than the 2p8t plan (docs/dry_run.md).
  Remat `full`: the planner's model misses a sixth of this step's compiled peak
  (docs/dry_run.md), so its `auto` plan does not fit."""
  cfg = _released("kimi-k3", MeshConfig(fsdp=2, expert=64), 64, 16384)
  return dataclasses.replace(cfg, memory=MemoryConfig(remat="full"))


PRESETS = {
    "tiny": tiny,
    "gpu-1": gpu_1,
    "2p8t": target_2p8t,
    "kimi-linear": kimi_linear,
    "deepseek-v3.2": deepseek_v32,
    "kimi-k3": kimi_k3,
}


def get_preset(name: str) -> Config:
  if name not in PRESETS:
    raise ConfigError(f"preset: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
  return PRESETS[name]()

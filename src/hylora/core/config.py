"""Typed configuration: frozen dataclasses, one per concern, gathered in `Config`.

Every field can be overridden from the command line as `--section.field=value`
(see `hylora.core.overrides`); `Config.validate()` checks the cross-field rules and names
the field at fault.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hylora.core.errors import ConfigError

RESIDUALS = ("add", "depth_mix", "block_attention")  # hylora.model.residual
ACTIVATIONS = ("silu", "situ")  # hylora.model.ffn.activations
REMAT_POLICIES = ("auto", "none", "full", "minimal", "tiered")  # hylora.model.remat_policy


@dataclass(frozen=True)
class LinearAttentionConfig:
  heads: int = 4
  head_dim: int = 16
  gate_rank: int = 8  # per-channel log-decay gate through a low-rank projection
  output_gate_rank: int = 8  # sigmoid output gate through a low-rank projection
  delta_rule: bool = True  # KDA (delta rule) when true, GLA otherwise
  chunk_size: int = 64
  gate_floor: float = -20.0  # lower bound of the log decay per token


@dataclass(frozen=True)
class KDAConfig:
  """Kimi Delta Attention as the Kimi Linear and Kimi K3 checkpoints define it
  (hylora.model.mixers.kda): q/k/v through short causal convolutions, a per-channel decay
  -exp(A_log) * softplus(f + dt_bias), beta = sigmoid(b_proj x), a gated output RMSNorm."""

  heads: int = 4
  head_dim: int = 16
  conv_size: int = 4  # short causal depthwise convolution (SiLU) on q, k and v
  gate_rank: int = 16  # forget gate: f_a (d -> rank) then f_b (rank -> heads x head_dim)
  output_gate_rank: int = 16  # output gate g_a / g_b; 0: one full-rank g_proj (K3)
  gate_lower_bound: float = 0.0  # < 0: K3's bounded decay (hylora.model.mixers.kda); 0: none
  chunk_size: int = 64


@dataclass(frozen=True)
class MLAConfig:
  """Multi-head latent attention (hylora.model.mixers.mla), with DeepSeek-V3.2's sparse
  attention indexer when `index_topk` > 0."""

  heads: int = 4
  q_rank: int = 0  # q_lora_rank: q_a_proj -> q_a_layernorm -> q_b_proj; 0: one q_proj
  kv_rank: int = 16  # kv_lora_rank
  nope_dim: int = 16  # qk_nope_head_dim
  rope_dim: int = 8  # qk_rope_head_dim: the part of each key shared by all heads
  v_dim: int = 16  # v_head_dim
  rope: bool = False  # RoPE (interleaved pairs) on the rope_dim part; False: NoPE (Kimi)
  rope_theta: float = 10000.0
  # YaRN context extension (DeepSeek): factor > 1 turns it on.
  yarn_factor: float = 1.0
  yarn_original_max_positions: int = 4096
  yarn_beta_fast: float = 32.0
  yarn_beta_slow: float = 1.0
  yarn_mscale: float = 1.0
  yarn_mscale_all_dim: float = 0.0
  output_gate: bool = False  # K3: the attention output times sigmoid(g_proj x)
  index_topk: int = 0  # > 0: the indexer picks this many keys per query (DeepSeek-V3.2)
  index_heads: int = 4
  index_head_dim: int = 16
  block_q: int = 64  # query block of the plain-JAX attention: no [T, T] array exists
  # key block of the attention on a sequence split over devices; why this size:
  # hylora/model/mixers/latent_attention_split.py
  block_k: int = 256


@dataclass(frozen=True)
class SparseAttentionConfig:
  q_heads: int = 4
  kv_heads: int = 2
  head_dim: int = 16
  top_k: int = 16
  index_heads: int = 2
  index_head_dim: int = 16
  index_q_rank: int = 16  # indexer queries through a low-rank projection
  rope_theta: float = 10000.0
  block_q: int = 64  # query block of the reference path: no [T, T] array exists
  indexer_loss_weight: float = 0.0  # KL(main attention || indexer); off for LoRA runs


@dataclass(frozen=True)
class MoEConfig:
  experts: int = 8
  top_k: int = 2
  expert_ffn: int = 32
  shared_experts: int = 1
  score_fn: str = "softmax"  # "softmax" or "sigmoid"
  normalize_top_k: bool = True  # renormalise the chosen experts' weights to sum to 1
  routed_scale: float = 1.0
  aux_loss_weight: float = 0.0  # load-balance loss in the training loss (router frozen under LoRA)
  z_loss_weight: float = 0.0
  # How tokens reach routed experts (hylora.model.ffn.dispatchers): "auto" is
  # "ep_alltoall" when the mesh has an expert axis > 1, else "dropless".
  dispatch: str = "auto"
  # Expert-parallel dispatch ("ep_alltoall", docs/moe.md):
  # > 0: at most factor * pairs / EP ranks rows per destination, the rest dropped (explicit);
  # <= 0: dropless, the rows moving in all-to-all rounds of `round_capacity` x that mean.
  capacity_factor: float = 0.0
  round_capacity: float = 1.25
  # Rounds after the first carry this x the mean each (their buffers come on top of the
  # first round's; few rows overflow a balanced step).
  overflow_round_capacity: float = 0.25
  transport: str = "padded"  # "padded" all_to_all (any backend) or "ragged" (GPU only)
  overlap_chunks: int = 1  # token chunks per device: one chunk's all-to-all overlaps another's FFN
  aux_loss_kind: str = "global"  # balance loss over the whole batch or per "sequence"
  # Balancing a frozen router during training (docs/moe.md, hylora.train.balancer):
  spare_slots: int = 0  # expert slots beyond `experts`: copies of hot experts
  rebalance_every: int = 0  # steps between re-placements of experts from the measured load; 0: off
  bias_update_every: int = 0  # steps between aux-loss-free router-bias updates; 0: off
  bias_update_rate: float = 1e-3  # bias step per update: b_e += rate * sign(mean - load_e)
  # Group-limited routing (DeepSeek-V3 n_group / topk_group): experts form `groups` equal
  # groups; a token picks its top_k among the `groups_kept` groups whose two best scores
  # sum highest.
  groups: int = 1
  groups_kept: int = 1
  # Latent MoE (K3, model.ffn = "latent_moe"): routed experts run on a `latent_dim`-wide
  # projection of the token (routed_expert_down_proj / _norm / _up_proj).
  latent_dim: int = 0

  @property
  def slots(self) -> int:
    """Stored expert slots: every expert once, plus the spare ones."""
    return self.experts + self.spare_slots


@dataclass(frozen=True)
class VisionConfig:
  """The image path (hylora.model.vision, docs/multimodal.md): a ViT encoder over square
  tiles, a projector into d_model, image tokens placed at placeholder positions."""

  enabled: bool = False
  image_size: int = 16  # side of one tile in pixels: the encoder's input
  patch_size: int = 4
  width: int = 32
  layers: int = 2
  heads: int = 2
  mlp: int = 64
  merge: int = 2  # merge x merge neighbouring patches become one image token
  max_tiles: int = 4  # an image becomes a grid of at most this many tiles (+ a thumbnail)
  max_image_side: int = 1024  # larger images are refused (or skipped: train.skip_bad_records)

  @property
  def grid(self) -> int:
    """Patches per tile side."""
    return self.image_size // self.patch_size

  @property
  def tokens_per_tile(self) -> int:
    return (self.grid // self.merge)**2


@dataclass(frozen=True)
class QuantizationConfig:
  """How the checkpoint stores the frozen base (its config.json's `quantization_config`,
  read by the family); the base stays so in memory (hylora.quant, docs/quantized_base.md)."""

  # "none" (bf16), "fp8_block" (e4m3 + 128x128 scales), "mxfp4" (e2m1 + e8m0 per 32
  # inputs), "int4" (compressed-tensors pack-quantized, group 32): QUANT_FORMATS.
  format: str = "none"
  # Checkpoint modules kept in bf16: exact names, or "re:REGEX" matched from the start
  # (compressed-tensors' `ignore`). Only linears of the quantized kinds are packed at all
  # (hylora.io.packed_scheme: never routers, norms, embeddings or lm_head).
  ignore: tuple[str, ...] = ()


QUANT_FORMATS = ("none", "fp8_block", "mxfp4", "int4")


@dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 256
  d_model: int = 32
  layers: int = 8
  pattern: tuple[str, ...] = ("linear", "linear", "linear", "sparse")
  dense_layers: int = 2  # the first k layers use a dense SwiGLU FFN instead of MoE
  dense_ffn: int = 64
  # How each layer reads the residual stream (hylora.model.residual, docs/day_one.md):
  # "add" (x + block(x)) or "depth_mix" (the block reads a learned mix of its input and
  # the outputs of the `residual_window` layers before it).
  residual: str = "add"
  residual_window: int = 2
  residual_block: int = 12  # "block_attention": layers per block (attn_res_block_size)
  # Per-layer mixer kinds; empty: `pattern` repeated. Released configs list them (1-based
  # layer lists in config.json, hylora.core.families).
  layer_types: tuple[str, ...] = ()
  ffn: str = "moe"  # the FFN kind of the layers after `dense_layers`: "moe" or "latent_moe"
  activation: str = "silu"  # of every gated MLP (dense, shared, routed): ACTIVATIONS
  situ_beta: float = 4.0  # "situ" (K3's SiTU-GLU): hylora.model.ffn.activations
  situ_linear_beta: float = 25.0
  # Whose checkpoint layout the base weights use (hylora.io.name_maps/<family>.toml).
  family: str = "hylora"
  norm_eps: float = 1e-6
  weight_dtype: str = "bfloat16"  # frozen base weights (float32 for exact debugging)
  init_std: float = 0.0  # random base weights: normal(std); 0 = fan-in scaling (1/sqrt(fan_in))
  linear_attention: LinearAttentionConfig = field(default_factory=LinearAttentionConfig)
  sparse_attention: SparseAttentionConfig = field(default_factory=SparseAttentionConfig)
  kda: KDAConfig = field(default_factory=KDAConfig)
  mla: MLAConfig = field(default_factory=MLAConfig)
  moe: MoEConfig = field(default_factory=MoEConfig)
  vision: VisionConfig = field(default_factory=VisionConfig)
  quantization: QuantizationConfig = field(default_factory=QuantizationConfig)

  def layer_kinds(self) -> list[tuple[str, str]]:
    """(mixer, ffn) for every layer, e.g. ("linear", "dense"), ("sparse", "moe")."""
    mixers = self.layer_types or tuple(
        self.pattern[i % len(self.pattern)] for i in range(self.layers))
    return [(mixers[i], "dense" if i < self.dense_layers else self.ffn) for i in range(self.layers)]


@dataclass(frozen=True)
class LoRAConfig:
  rank: int = 4
  alpha: float = 8.0
  dropout: float = 0.0
  # Which linears get adapters, by their names in the model (fnmatch patterns).
  targets: tuple[str, ...] = ("q", "k", "v", "o", "gate_up")
  shared_expert_a: bool = False  # one A shared by all routed experts (B stays per expert)

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


@dataclass(frozen=True)
class MeshConfig:
  fsdp: int = -1  # -1: whatever the device count leaves after `expert`
  expert: int = 1
  # > 0: the run uses the host's first N devices, N simulated CPU devices on a host without
  # accelerators (meshes.mesh.request_devices); 0: all devices present (a fixed fsdp x
  # expert mesh smaller than the host takes its first devices).
  devices: int = 0
  min_shard_size: int = 0  # parameters with fewer elements stay replicated


@dataclass(frozen=True)
class KernelConfig:
  """Which implementation each registered op uses: "auto", "reference" or a name."""

  linear_attention: str = "auto"
  sparse_attention: str = "auto"
  topk_indices: str = "auto"
  grouped_matmul: str = "auto"
  cross_entropy: str = "auto"
  residual_mix: str = "auto"
  short_conv: str = "auto"  # the KDA layer's short convolutions, SiLU and q / k L2 norm
  causal_attention: str = "auto"  # full attention (MLA layers without an indexer)
  quantized_matmul: str = "auto"  # products with packed frozen weights (hylora.quant)


@dataclass(frozen=True)
class MemoryConfig:
  # "auto": the memory planner's policy for the run's devices (hylora.plan.run_plan);
  # or one of "none", "full", "minimal", "tiered".
  remat: str = "auto"
  # The HBM per device that "auto" plans for (and a dry run's verdict uses); a device that
  # reports less uses its own limit.
  device_memory: float = 141e9
  # "auto": the share of device_memory the planner leaves for what its model does not
  # count (fusion temporaries, the compiler's schedule; docs/memory.md).
  plan_headroom: float = 0.07
  hbm_names: tuple[str, ...] = ()  # tiered: save points kept in device memory
  host_names: tuple[str, ...] = ()  # tiered: save points offloaded to pinned host memory
  # tiered: "auto" offloads where the backend has pinned host memory inside jit (GPU, TPU)
  # and keeps host_names in device memory elsewhere (CPU); "on" always emits the offload
  # (lowering for another platform); "off" never offloads.
  host_offload: str = "auto"


@dataclass(frozen=True)
class TrainConfig:
  steps: int = 60
  batch_size: int = 8  # sequences per optimizer step (global)
  seq_len: int = 128
  grad_accum: int = 1  # micro-batches per optimizer step
  learning_rate: float = 3e-3
  warmup_steps: int = 5
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.0
  clip_norm: float = 1.0
  b1: float = 0.9
  b2: float = 0.999
  seed: int = 0
  data: str = "synthetic"  # "synthetic" or a path to a .jsonl / .npy file of token ids
  synthetic_docs: tuple[int, int] = (16, 96)  # min/max document length of the synthetic source
  # Conversation / plain-text .jsonl data (hylora.data, docs/multimodal.md):
  tokenizer: str = ""  # tokenizer.json; empty: the one next to the data file
  chat_template: str = "chatml"  # hylora.data.chat.TEMPLATES
  tiles_per_row: int = 8  # image tiles each packed row can carry (fixed batch shape)
  skip_bad_records: bool = False  # skip (and count) bad records instead of stopping
  max_nonfinite_in_a_row: int = 5  # non-finite steps (update skipped) tolerated in a row


@dataclass(frozen=True)
class CheckpointConfig:
  """Base weights in, training state out (docs/checkpoints.md)."""

  base_weights: str = ""  # HF-layout folder (safetensors + config.json); "": random weights
  ignore_tensors: str = ""  # regex: checkpoint tensors that are not part of the model
  every: int = 0  # save every N steps (0: only after the last step)
  keep: int = 3  # the last K checkpoints stay on disk
  async_save: bool = True  # write while training continues
  # A merged export (--merge) of a packed base: written as a bf16 copy (the base
  # dequantized, plus the adapters) only when this says so (--merge-dequantized).
  merge_dequantized: bool = False


@dataclass(frozen=True)
class Config:
  preset: str = "tiny"
  model: ModelConfig = field(default_factory=ModelConfig)
  lora: LoRAConfig = field(default_factory=LoRAConfig)
  mesh: MeshConfig = field(default_factory=MeshConfig)
  kernels: KernelConfig = field(default_factory=KernelConfig)
  memory: MemoryConfig = field(default_factory=MemoryConfig)
  train: TrainConfig = field(default_factory=TrainConfig)
  checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

  def validate(self) -> "Config":
    m, t = self.model, self.train
    _check(m.layers >= 1, "model.layers", f"must be >= 1, got {m.layers}")
    from hylora.core.architecture import MIXER_BLOCKS  # the layer kinds described
    from hylora.core.architecture import FFN_BLOCKS
    _check(all(p in MIXER_BLOCKS for p in m.pattern), "model.pattern",
           f"entries must be in {tuple(MIXER_BLOCKS)}, got {m.pattern}")
    _check(len(m.pattern) >= 1, "model.pattern", "must not be empty")
    if m.layer_types:
      _check(
          len(m.layer_types) == m.layers, "model.layer_types",
          f"lists {len(m.layer_types)} layers, model.layers={m.layers}")
      _check(all(p in MIXER_BLOCKS for p in m.layer_types), "model.layer_types",
             f"entries must be in {tuple(MIXER_BLOCKS)}, got {sorted(set(m.layer_types))}")
    _check(m.ffn in FFN_BLOCKS and m.ffn != "dense", "model.ffn",
           f"must be one of {tuple(k for k in FFN_BLOCKS if k != 'dense')}, got {m.ffn!r}")
    _check(m.activation in ACTIVATIONS, "model.activation",
           f"must be one of {ACTIVATIONS}, got {m.activation!r}")
    _check(m.residual_block >= 1, "model.residual_block", f"must be >= 1, got {m.residual_block}")
    mixers = set(m.layer_types or m.pattern)
    if "mla" in mixers and m.mla.index_topk > 0:
      _check(m.mla.q_rank > 0, "model.mla.q_rank",
             "the sparse-attention indexer reads the low-rank query: set q_rank > 0")
    if "kda" in mixers:
      _check(m.kda.gate_lower_bound <= 0, "model.kda.gate_lower_bound",
             f"a log decay bound must be <= 0, got {m.kda.gate_lower_bound}")
    _check(m.quantization.format in QUANT_FORMATS, "model.quantization.format",
           f"must be one of {QUANT_FORMATS}, got {m.quantization.format!r}")
    _check(m.residual in RESIDUALS, "model.residual",
           f"must be one of {RESIDUALS}, got {m.residual!r}")
    _check(m.residual_window >= 1, "model.residual_window",
           f"must be >= 1, got {m.residual_window}")
    _check(0 <= m.dense_layers <= m.layers, "model.dense_layers",
           f"must be in [0, layers={m.layers}], got {m.dense_layers}")
    _check(m.weight_dtype in ("bfloat16", "float32", "float16"), "model.weight_dtype",
           f"must be bfloat16, float32 or float16, got {m.weight_dtype!r}")
    sa = m.sparse_attention
    _check(sa.q_heads % sa.kv_heads == 0, "model.sparse_attention.q_heads",
           f"{sa.q_heads} is not a multiple of kv_heads={sa.kv_heads}")
    _check(sa.head_dim % 2 == 0, "model.sparse_attention.head_dim", "must be even (RoPE)")
    moe = m.moe
    _check(1 <= moe.top_k <= moe.experts, "model.moe.top_k",
           f"must be in [1, experts={moe.experts}], got {moe.top_k}")
    _check(moe.score_fn in ("softmax", "sigmoid"), "model.moe.score_fn",
           f"must be 'softmax' or 'sigmoid', got {moe.score_fn!r}")
    _check(moe.groups >= 1 and moe.experts % moe.groups == 0, "model.moe.groups",
           f"{moe.groups} does not divide model.moe.experts={moe.experts} into equal groups")
    _check(1 <= moe.groups_kept <= moe.groups, "model.moe.groups_kept",
           f"must be in [1, groups={moe.groups}], got {moe.groups_kept}")
    _check(moe.top_k <= moe.groups_kept * (moe.experts // max(moe.groups, 1)), "model.moe.top_k",
           f"{moe.top_k} exceeds the experts of the {moe.groups_kept} kept groups")
    _check((moe.latent_dim > 0) == (m.ffn == "latent_moe"), "model.moe.latent_dim",
           f"latent_moe layers need latent_dim > 0 and only they use it (model.ffn={m.ffn!r}, "
           f"latent_dim={moe.latent_dim})")
    for name in ("round_capacity", "overflow_round_capacity"):
      _check(
          getattr(moe, name) > 0, f"model.moe.{name}",
          f"must be > 0 (rows per all-to-all round, as a multiple of the mean), got "
          f"{getattr(moe, name)}")
    _check(moe.transport in ("padded", "ragged"), "model.moe.transport",
           f"must be 'padded' or 'ragged', got {moe.transport!r}")
    _check(moe.overlap_chunks >= 1, "model.moe.overlap_chunks",
           f"must be >= 1, got {moe.overlap_chunks}")
    _check(moe.aux_loss_kind in ("global", "sequence"), "model.moe.aux_loss_kind",
           f"must be 'global' or 'sequence', got {moe.aux_loss_kind!r}")
    for name in ("spare_slots", "rebalance_every", "bias_update_every"):
      _check(
          getattr(moe, name) >= 0, f"model.moe.{name}", f"must be >= 0, got {getattr(moe, name)}")
    _check(moe.bias_update_rate > 0 or moe.bias_update_every == 0, "model.moe.bias_update_rate",
           f"must be > 0 when model.moe.bias_update_every > 0, got {moe.bias_update_rate}")
    _check(self.lora.rank >= 1, "lora.rank", f"must be >= 1, got {self.lora.rank}")
    _check(0.0 <= self.lora.dropout < 1.0, "lora.dropout", "must be in [0, 1)")
    _check(self.memory.remat in REMAT_POLICIES, "memory.remat",
           f"must be one of {'/'.join(REMAT_POLICIES)}, got {self.memory.remat!r}")
    _check(self.memory.device_memory > 0, "memory.device_memory",
           f"must be > 0 bytes, got {self.memory.device_memory}")
    _check(0 <= self.memory.plan_headroom < 1, "memory.plan_headroom",
           f"must be in [0, 1), got {self.memory.plan_headroom}")
    _check(t.steps >= 1, "train.steps", f"must be >= 1, got {t.steps}")
    _check(t.grad_accum >= 1, "train.grad_accum", f"must be >= 1, got {t.grad_accum}")
    _check(t.batch_size % t.grad_accum == 0, "train.batch_size",
           f"{t.batch_size} is not divisible by train.grad_accum={t.grad_accum}")
    _check(t.seq_len >= 2, "train.seq_len", f"must be >= 2, got {t.seq_len}")
    _check(t.max_nonfinite_in_a_row >= 1, "train.max_nonfinite_in_a_row",
           f"must be >= 1, got {t.max_nonfinite_in_a_row}")
    _check(self.checkpoint.every >= 0, "checkpoint.every",
           f"must be >= 0, got {self.checkpoint.every}")
    _check(self.checkpoint.keep >= 1, "checkpoint.keep",
           f"must be >= 1, got {self.checkpoint.keep}")
    v = m.vision
    if v.enabled:
      _check(v.image_size % v.patch_size == 0, "model.vision.image_size",
             f"{v.image_size} is not a multiple of model.vision.patch_size={v.patch_size}")
      _check(v.grid % v.merge == 0, "model.vision.merge",
             f"{v.merge} does not divide the {v.grid} patches per tile side")
      _check(v.width % v.heads == 0, "model.vision.width",
             f"{v.width} is not a multiple of model.vision.heads={v.heads}")
      _check(v.max_tiles >= 1, "model.vision.max_tiles", f"must be >= 1, got {v.max_tiles}")
      most = v.max_tiles + (1 if v.max_tiles > 1 else 0)  # the grid and its thumbnail
      _check(
          t.tiles_per_row == 0 or t.tiles_per_row >= most, "train.tiles_per_row",
          f"{t.tiles_per_row} slots cannot hold one image of model.vision.max_tiles="
          f"{v.max_tiles} tiles plus its thumbnail ({most}); use >= {most}, or 0 for "
          "text-only data")
    _check(t.tiles_per_row >= 0, "train.tiles_per_row", f"must be >= 0, got {t.tiles_per_row}")
    la = m.linear_attention
    _check(la.chunk_size == 64, "model.linear_attention.chunk_size",
           f"the kernels run chunks of 64 tokens, got {la.chunk_size}")
    if {"linear", "kda"} & set(m.layer_types or m.pattern):
      _check(
          t.seq_len % la.chunk_size == 0, "train.seq_len",
          f"{t.seq_len} is not a multiple of model.linear_attention.chunk_size="
          f"{la.chunk_size} (packed rows run whole chunks)")
    return self


def _check(ok: bool, name: str, message: str):
  if not ok:
    raise ConfigError(f"{name}: {message}")

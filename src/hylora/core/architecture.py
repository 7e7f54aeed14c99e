"""The architecture, described once.

For every layer kind (a mixer: "linear", "sparse"; an FFN: "dense", "moe") a `Block` lists
the tensors it holds (their paths inside a decoder layer, their parameter kind and their
checkpoint names) and the work it does for n tokens: each save point's bytes and its
forward and backward FLOPs. `layer_plans` says which blocks each layer has and where its
parameters sit in the scanned stack (`hylora.model.stack`).

Everything that needs the architecture reads it from here: the checkpoint names
(`hylora.io.hf_names`), the save-point sizes of the memory planner
(`hylora.plan.save_point_sizes`), the parameter counts by kind (`hylora.plan.param_count`)
and the FLOP count of a train step (`step_flops`). A new layer kind is a new `Block` in
`MIXER_BLOCKS` or `FFN_BLOCKS` (and its module in `hylora.model`); a kind missing here is
an error wherever it is asked for, never sized like another.

FLOPs count the work as it really is: a frozen weight has no weight gradient, so a frozen
linear's backward is its input gradient alone (1x the forward); a LoRA adapter's backward
computes both factors' gradients and the input gradient (2x); the attention cores'
backward is 2x their forward; the top-K selection is not differentiated (stopped at the
indexer's inputs).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Callable

from hylora.core import save_points as sp
from hylora.core.config import Config, LoRAConfig, ModelConfig
from hylora.core.errors import ConfigError

# ---- tensors ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One parameter of a block: where it sits and what the checkpoint calls it.

  Layouts on disk: `linear` is a torch `nn.Linear` weight `[out, in]` (the model kernel
  `[*in, *out]` is its transpose, reshaped; heads stay major); several `names` are linear
  weights stacked along `out` (the model's fused gate_up is gate_proj then up_proj);
  otherwise the tensor has the model leaf's shape."""

  path: str  # leaf path inside a decoder layer (inside the model for MODEL_TENSORS)
  kind: str  # parameter kind (PARAMETER_KINDS)
  names: tuple[str, ...] = ()  # checkpoint name(s); several: fused along the output dimension
  linear: bool = False  # torch Linear layout [out, in]
  in_dims: int = 1  # how many leading dims of the model kernel form `in`
  per_expert: bool = False  # one tensor per routed expert ("{e}" in the names)
  optional: bool = False  # may be absent from a checkpoint: loaded as zeros
  adapter: str | None = None  # module holding lora_a / lora_b for this weight (PEFT export)
  fill: str | None = None  # no checkpoint tensor: "expert_ids" = the initial expert placement


def _linear(path: str, kind: str, *names: str, in_dims: int = 1, adapter: bool = True) -> Tensor:
  """A Linear module's kernel; its adapter (if any) sits next to the kernel."""
  module = path.rsplit("/", 1)[0]
  return Tensor(path, kind, names, linear=True, in_dims=in_dims,
                adapter=module if adapter else None)


# Parameter kinds, for counts (`hylora.plan.param_count`) and the dry run's array table.
PARAMETER_KINDS = ("experts", "shared_experts", "dense_ffn", "attention", "router", "norms",
                   "embeddings", "vision", "other")

# ---- work -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Work:
  """What one piece of a block costs for the tokens it is asked about.

  `nbytes`: what keeping its save point costs; `forward` / `backward`: model FLOPs (the
  backward as the rules of the module doc); `executed`: how many FLOPs the chosen
  implementation runs per model FLOP (masked dense attention computes the causal half of
  every pair; capacity-padded expert buffers compute their padding)."""

  save_point: str
  nbytes: int = 0
  forward: float = 0.0
  backward: float = 0.0
  executed: float = 1.0


def lora_targets(lora: LoRAConfig | None, name: str) -> bool:
  """Whether the linear named `name` gets an adapter under `lora.targets`."""
  return lora is not None and any(fnmatch.fnmatchcase(name, p) for p in lora.targets)


def frozen_linear(save_as: str, n: int, fan_in: int, fan_out: int, lora: LoRAConfig | None,
                  name: str) -> list[Work]:
  """y = x W (+ x A B): its output kept as `save_as`, the adapter's x A as LORA_A."""
  work = [Work(save_as, n * fan_out * 2, 2.0 * n * fan_in * fan_out, 2.0 * n * fan_in * fan_out)]
  if lora_targets(lora, name):
    r = lora.rank
    lora_flops = 2.0 * n * fan_in * r + 2.0 * n * r * fan_out
    work.append(Work(sp.LORA_A, n * r * 2, lora_flops, 2.0 * lora_flops))
  return work


def _norm(save_as: str, n: int, d: int) -> Work:
  return Work(save_as, n * d * 2, 4.0 * n * d, 4.0 * n * d)


# ---- blocks -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Block:
  """One layer kind: the tensors it holds and the work it does.

  work(cfg, n) -> [Work] for n tokens on one device (rows of train.seq_len)."""

  name: str
  tensors: tuple[Tensor, ...]
  work: Callable[[Config, int], list[Work]]


def _linear_attention_work(cfg: Config, n: int) -> list[Work]:
  m, lora = cfg.model, cfg.lora
  la, d = m.linear_attention, m.d_model
  hd = la.heads * la.head_dim
  work = [Work(sp.LAYER_INPUT, n * d * 2), _norm(sp.MIXER_NORM, n, d)]
  for name in ("q", "k", "v"):
    work += frozen_linear(sp.QKV, n, d, hd, lora, name)
  gate_flops = 2.0 * n * (d * la.gate_rank + la.gate_rank * hd)
  gate_flops += 2.0 * n * (d * la.output_gate_rank + la.output_gate_rank * hd)
  gate_bytes = 2 * n * hd * 4  # decay and output gate, fp32
  if la.delta_rule:
    gate_flops += 2.0 * n * d * la.heads
    gate_bytes += n * la.heads * 4
  work.append(Work(sp.GATES, gate_bytes, gate_flops, gate_flops))
  # The chunked core per token and head (c: chunk, h: head dim): scores and their product
  # with the values over the causal half of a chunk (2ch), the state read and its update
  # (4h^2). The delta rule adds the key-key scores, the in-chunk inverse applied to keys
  # and values and the values' correction against the state (3ch + 2h^2).
  c, h = la.chunk_size, la.head_dim
  per_head = (5 * c * h + 6 * h * h) if la.delta_rule else (2 * c * h + 4 * h * h)
  # Kept for the backward besides the output (pallas_kernels/residuals.py), per token and
  # head: KDA qg, kg, w, v_new, A_qk, (I + A_kk)^-1 and the chunk states (bf16); GLA its
  # in-chunk scores (fp32).
  kept = 2 * (4 * h + 2 * c + h * h // c) if la.delta_rule else 4 * c
  core = float(n) * la.heads * per_head
  work.append(Work(sp.ATTENTION, n * hd * 2 + n * la.heads * kept, core, 2.0 * core))
  work += frozen_linear(sp.MIXER_OUT, n, hd, d, lora, "o")
  return work


def _sparse_attention_is_masked_dense(cfg: Config, n: int) -> bool:
  """Whether the sparse layers run masked dense attention on GPU: chosen by name, or by
  `auto` through pallas_kernels/sparse_attention/by_density.py."""
  choice = cfg.kernels.sparse_attention
  if choice == "masked_dense":
    return True
  if choice not in ("auto", "by_density"):
    return False
  from pallas_kernels.sparse_attention.by_density import prefers_dense
  sa, seq = cfg.model.sparse_attention, cfg.train.seq_len
  rows = max(1, n // seq)
  return prefers_dense((rows, seq, sa.q_heads, sa.head_dim), (rows, seq, sa.kv_heads, sa.head_dim),
                       sa.top_k, "bfloat16")


def _sparse_attention_work(cfg: Config, n: int) -> list[Work]:
  m, lora = cfg.model, cfg.lora
  sa, d, seq = m.sparse_attention, m.d_model, cfg.train.seq_len
  q_dim, kv_dim = sa.q_heads * sa.head_dim, sa.kv_heads * sa.head_dim
  work = [Work(sp.LAYER_INPUT, n * d * 2), _norm(sp.MIXER_NORM, n, d)]
  work += frozen_linear(sp.QKV, n, d, q_dim, lora, "q")
  work += frozen_linear(sp.QKV, n, d, kv_dim, lora, "k")
  work += frozen_linear(sp.QKV, n, d, kv_dim, lora, "v")
  ih, ihd = sa.index_heads, sa.index_head_dim
  # The indexer runs forward only: the selection is stopped at its inputs.
  work.append(
      Work(sp.INDEXER, n * (ih * ihd * 2 + ihd * 2 + ih * 4),
           2.0 * n * (d * sa.index_q_rank + sa.index_q_rank * ih * ihd + d * ihd + d * ih)))
  # Scores over the causal keys (on average half the row), then the top-K pick.
  work.append(Work(sp.TOPK, n * sa.top_k * 4, float(n) * seq * ih * ihd))
  # q.k and p.v over the selected keys. Kept: the output and the log-sum-exp; masked dense
  # attention also keeps the selection as a bf16 bias (2 bytes per query and key) and
  # computes the causal half of all pairs.
  keys = min(sa.top_k, seq)
  extra, executed = 0, 1.0
  if _sparse_attention_is_masked_dense(cfg, n):
    extra, executed = n * seq * 2, (seq // 2) / keys
  core = 4.0 * n * sa.q_heads * keys * sa.head_dim
  work.append(
      Work(sp.ATTENTION, n * q_dim * 2 + n * sa.q_heads * 4 + extra, core, 2.0 * core, executed))
  work += frozen_linear(sp.MIXER_OUT, n, q_dim, d, lora, "o")
  return work


def _swiglu(n: int, d: int, ffn: int, lora: LoRAConfig | None) -> list[Work]:
  return (frozen_linear(sp.MLP_GATE_UP, n, d, 2 * ffn, lora, "gate_up") +
          frozen_linear(sp.MLP_DOWN, n, ffn, d, lora, "down"))


def _dense_ffn_work(cfg: Config, n: int) -> list[Work]:
  m = cfg.model
  return [_norm(sp.FFN_NORM, n, m.d_model)] + _swiglu(n, m.d_model, m.dense_ffn, cfg.lora)


def _moe_work(cfg: Config, n: int) -> list[Work]:
  m, lora = cfg.model, cfg.lora
  moe, d = m.moe, m.d_model
  f, pairs = moe.expert_ffn, n * moe.top_k
  computed = pairs
  if moe.dispatch == "ep_alltoall" and moe.capacity_factor > 0:
    # the experts compute every row of the capacity-sized receive buffers
    computed = math.ceil(pairs * max(1.0, moe.capacity_factor))
  padding = computed / pairs
  work = [
      _norm(sp.FFN_NORM, n, d),
      Work(sp.ROUTER, n * moe.experts * 4, 2.0 * n * d * moe.experts, 2.0 * n * d * moe.experts),
      Work(sp.EXPERT_INPUT, computed * d * 2)
  ]
  gate_up = 2.0 * pairs * d * 2 * f
  work.append(Work(sp.EXPERT_GATE_UP, computed * 2 * f * 2, gate_up, gate_up, padding))
  if lora_targets(lora, "gate_up"):
    adapters = 2.0 * pairs * lora.rank * (d + 2 * f)
    work.append(Work(sp.EXPERT_GATE_UP, 0, adapters, 2.0 * adapters, padding))
  down = 2.0 * pairs * f * d
  work.append(Work(sp.EXPERT_DOWN, computed * d * 2, down, down, padding))
  if moe.shared_experts > 0:
    work += _swiglu(n, d, f * moe.shared_experts, lora)
  return work


_ATTENTION_PROJECTIONS = (
    _linear("mixer/q/kernel", "attention", "self_attn.q_proj.weight"),
    _linear("mixer/k/kernel", "attention", "self_attn.k_proj.weight"),
    _linear("mixer/v/kernel", "attention", "self_attn.v_proj.weight"),
    _linear("mixer/o/kernel", "attention", "self_attn.o_proj.weight", in_dims=2),
)


def _swiglu_tensors(module: str, kind: str, prefix: str) -> tuple[Tensor, ...]:
  return (_linear(f"{module}/gate_up/kernel", kind, f"{prefix}.gate_proj.weight",
                  f"{prefix}.up_proj.weight"),
          _linear(f"{module}/down/kernel", kind, f"{prefix}.down_proj.weight"))


MIXER_BLOCKS: dict[str, Block] = {
    # Chunked linear attention (GLA / KDA): low-rank decay gate (f), output gate (g),
    # delta-rule beta (b), a per-head output norm.
    "linear":
        Block(
            "linear", _ATTENTION_PROJECTIONS + (
                _linear("mixer/decay_down/kernel", "attention", "self_attn.f_a_proj.weight"),
                _linear("mixer/decay_up/kernel", "attention", "self_attn.f_b_proj.weight"),
                _linear("mixer/out_gate_down/kernel", "attention", "self_attn.g_a_proj.weight"),
                _linear("mixer/out_gate_up/kernel", "attention", "self_attn.g_b_proj.weight"),
                _linear("mixer/beta/kernel", "attention", "self_attn.b_proj.weight"),
                Tensor("mixer/head_norm", "norms", ("self_attn.o_norm.weight",)),
            ), _linear_attention_work),
    # Top-K sparse attention and its indexer.
    "sparse":
        Block(
            "sparse", _ATTENTION_PROJECTIONS + (
                _linear("mixer/index_q_down/kernel", "attention",
                        "self_attn.indexer.q_a_proj.weight"),
                _linear("mixer/index_q_up/kernel", "attention",
                        "self_attn.indexer.q_b_proj.weight"),
                _linear("mixer/index_k/kernel", "attention", "self_attn.indexer.k_proj.weight"),
                _linear("mixer/index_w/kernel", "attention",
                        "self_attn.indexer.weights_proj.weight"),
            ), _sparse_attention_work),
}

FFN_BLOCKS: dict[str, Block] = {
    # The first `dense_layers` layers.
    "dense":
        Block("dense", _swiglu_tensors("ffn/mlp", "dense_ffn", "mlp"), _dense_ffn_work),
    # Router, routed experts (stacked along the expert axis), shared experts. The slot ->
    # expert table (hylora.model.ffn.placement) has no checkpoint tensor: checkpoints store
    # experts in logical order, so loading starts from the initial placement.
    "moe":
        Block("moe", (
            _linear("ffn/router/kernel", "router", "mlp.gate.weight", adapter=False),
            Tensor("ffn/router/bias", "router",
                   ("mlp.gate.e_score_correction_bias",), optional=True),
            Tensor("ffn/placement", "other", (), fill="expert_ids"),
            Tensor("ffn/experts/gate_up", "experts",
                   ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
                   linear=True, per_expert=True, adapter="ffn/experts"),
            Tensor("ffn/experts/down", "experts",
                   ("mlp.experts.{e}.down_proj.weight",), linear=True, per_expert=True),
        ) + _swiglu_tensors("ffn/shared", "shared_experts", "mlp.shared_experts"), _moe_work),
}

# Every decoder layer's own tensors, whatever its blocks.
LAYER_TENSORS: tuple[Tensor, ...] = (
    Tensor("mixer_norm/scale", "norms", ("input_layernorm.weight",)),
    Tensor("ffn_norm/scale", "norms", ("post_attention_layernorm.weight",)),
    # "depth_mix" residual: the block input's mixing weights (trainable, not frozen)
    Tensor("residual/weights", "other", ("residual_mix.weight",)),
)

# Tensors outside the decoder layers (paths from the model's root; absolute names).
MODEL_TENSORS: tuple[Tensor, ...] = (
    Tensor("embed", "embeddings", ("model.embed_tokens.weight",)),
    Tensor("final_norm/scale", "norms", ("model.norm.weight",)),
    Tensor("lm_head", "embeddings", ("lm_head.weight",), linear=True),
)

# The vision tower's tensors keep the model's own layout under `vision/` (hylora.io.hf_names).
VISION_ROOT = "vision"


def mixer_block(kind: str) -> Block:
  if kind not in MIXER_BLOCKS:
    raise ConfigError(f"model.pattern: no layer kind {kind!r}; known mixers: "
                      f"{sorted(MIXER_BLOCKS)}")
  return MIXER_BLOCKS[kind]


def ffn_block(kind: str) -> Block:
  if kind not in FFN_BLOCKS:
    raise ConfigError(f"FFN kind {kind!r} is not described; known: {sorted(FFN_BLOCKS)}")
  return FFN_BLOCKS[kind]


# ---- the layer plan ---------------------------------------------------------------------


def plan_segments(kinds: list[tuple[str, str]], period: int):
  """[(period kinds, repeats)] covering `kinds` in order: consecutive identical periods
  of `period` layers form one segment (stacked and scanned by hylora.model.stack)."""
  segments: list[list] = []
  for start in range(0, len(kinds), period):
    chunk = tuple(kinds[start:start + period])
    if segments and segments[-1][0] == chunk:
      segments[-1][1] += 1
    else:
      segments.append([chunk, 1])
  return [(chunk, repeats) for chunk, repeats in segments]


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """One decoder layer: its blocks and where its parameters sit in the stack
  (`stack/segments/<segment>/periods/layers/<position>/...`, entry `repeat` of the
  leading `layers` axis)."""

  index: int
  mixer: str
  ffn: str
  segment: int
  position: int
  repeat: int

  @property
  def blocks(self) -> tuple[Block, Block]:
    return mixer_block(self.mixer), ffn_block(self.ffn)

  @property
  def tensors(self) -> tuple[Tensor, ...]:
    mixer, ffn = self.blocks
    return LAYER_TENSORS + mixer.tensors + ffn.tensors

  def work(self, cfg: Config, n: int) -> list[Work]:
    mixer, ffn = self.blocks
    return mixer.work(cfg, n) + ffn.work(cfg, n)


def layer_plans(m: ModelConfig) -> list[LayerPlan]:
  """Every decoder layer in order; an undescribed kind is a ConfigError."""
  plans, index = [], 0
  for segment, (chunk, repeats) in enumerate(plan_segments(m.layer_kinds(), len(m.pattern))):
    for repeat in range(repeats):
      for position, (mixer, ffn) in enumerate(chunk):
        mixer_block(mixer), ffn_block(ffn)
        plans.append(LayerPlan(index, mixer, ffn, segment, position, repeat))
        index += 1
  return plans


STACK_PATH = ("stack", "segments")


def stacked_position(keys: tuple) -> tuple[int, int, str] | None:
  """(segment, position in the period, path inside the layer) of a leaf under
  `stack/segments/<s>/periods/layers/<i>/...`; None for any other leaf."""
  if keys[:2] == STACK_PATH and len(keys) > 6 and tuple(keys[3:5]) == ("periods", "layers"):
    return int(keys[2]), int(keys[5]), "/".join(map(str, keys[6:]))
  return None


def stacked_layers(m: ModelConfig, segment: int, position: int) -> tuple[int, ...]:
  """The global layer index of each entry of a stacked leaf's `layers` axis."""
  return tuple(p.index for p in layer_plans(m) if (p.segment, p.position) == (segment, position))


# ---- reading the description ------------------------------------------------------------


def tensor_at(rel: str, tensors: tuple[Tensor, ...]) -> Tensor | None:
  """The tensor at `rel`, else the one whose module holds `rel` (an adapter factor)."""
  for t in tensors:
    if rel == t.path:
      return t
  holders = [t for t in tensors if t.adapter and rel.startswith(t.adapter + "/")]
  return max(holders, key=lambda t: len(t.adapter), default=None)


ALL_LAYER_TENSORS: tuple[Tensor, ...] = LAYER_TENSORS + tuple(
    t for block in (*MIXER_BLOCKS.values(), *FFN_BLOCKS.values()) for t in block.tensors)


def parameter_kind(keys: tuple[str, ...]) -> str:
  """The parameter kind of the leaf at `keys` (a pure-dict path of the model)."""
  keys = tuple(map(str, keys))
  if keys[0] == VISION_ROOT:
    return "vision"
  stacked = stacked_position(keys)
  if stacked is not None:
    tensor = tensor_at(stacked[2], ALL_LAYER_TENSORS)
  else:
    tensor = tensor_at("/".join(keys), MODEL_TENSORS)
  return tensor.kind if tensor is not None else "other"


def step_flops(cfg: Config) -> dict[str, float]:
  """Model FLOPs of one optimizer step (every token of the global batch, forward and
  backward), by block kind, plus the LM head."""
  m, t = cfg.model, cfg.train
  tokens = t.batch_size * t.seq_len
  out: dict[str, float] = {}
  per_kind: dict[tuple[str, str], float] = {}
  for plan in layer_plans(m):
    for role, kind in (("mixer", plan.mixer), ("ffn", plan.ffn)):
      if (role, kind) not in per_kind:
        block = mixer_block(kind) if role == "mixer" else ffn_block(kind)
        per_kind[role, kind] = sum(w.forward + w.backward for w in block.work(cfg, tokens))
      out[kind] = out.get(kind, 0.0) + per_kind[role, kind]
  out["lm_head"] = 4.0 * tokens * m.d_model * m.vocab_size  # forward and input gradient
  return out

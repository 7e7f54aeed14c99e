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
  """One parameter of a block: where it sits and how a checkpoint lays it out. Its names
  in a checkpoint belong to the checkpoint's family (`hylora.io.name_maps`).

  Layouts on disk: `linear` is a torch `nn.Linear` weight `[out, in]` (the model kernel
  `[*in, *out]` is its transpose, reshaped; heads stay major); a name map that gives
  several names for one linear stacks them along `out` (the model's fused gate_up is
  gate_proj then up_proj); `disk` names a reshape (DISK_LAYOUTS) for tensors stored in
  another shape; otherwise the tensor has the model leaf's shape."""

  path: str  # leaf path inside a decoder layer (inside the model for MODEL_TENSORS)
  kind: str  # parameter kind (PARAMETER_KINDS)
  linear: bool = False  # torch Linear layout [out, in]
  in_dims: int = 1  # how many leading dims of the model kernel form `in`
  per_expert: bool = False  # one tensor per routed expert ("{e}" in the names)
  optional: bool = False  # may be absent from a checkpoint: loaded as zeros
  adapter: str | None = None  # module holding lora_a / lora_b for this weight (PEFT export)
  fill: str | None = None  # no checkpoint tensor: "expert_ids" = the initial expert placement
  disk: str = ""  # DISK_LAYOUTS key: the checkpoint stores a reshape of the model's slice

  def disk_shape(self, item: tuple[int, ...]) -> tuple[int, ...]:
    """The checkpoint shape of one model slice of shape `item` (non-linear tensors)."""
    return DISK_LAYOUTS[self.disk](item) if self.disk else tuple(item)


# Checkpoint shapes that are reshapes of the model's (same elements, same order).
DISK_LAYOUTS: dict[str, Callable[[tuple[int, ...]], tuple[int, ...]]] = {
    # depthwise Conv1d weight [channels, 1, taps] for the model's [heads, head_dim, taps]
    "conv1d": lambda s: (s[0] * s[1], 1, s[2]),
    # one vector over heads x head_dim for the model's [heads, head_dim]
    "flat": lambda s: (math.prod(s),),
    # Kimi Linear's A_log [1, 1, heads, 1] for the model's [heads]
    "heads_4d": lambda s: (1, 1, s[0], 1),
    # a Linear(d, 1) weight [1, d] for the model's vector [d]
    "row": lambda s: (1, s[0]),
}


def _linear(path: str, kind: str, in_dims: int = 1, adapter: bool = True) -> Tensor:
  """A Linear module's kernel; its adapter (if any) sits next to the kernel."""
  module = path.rsplit("/", 1)[0]
  return Tensor(path, kind, linear=True, in_dims=in_dims, adapter=module if adapter else None)


# Parameter kinds, for counts (`hylora.plan.param_count`) and the dry run's array table.
# `expert_latent`: the latent MoE's projections into and out of the experts' width (every
# token uses them, unlike the routed experts themselves).
PARAMETER_KINDS = ("experts", "expert_latent", "shared_experts", "dense_ffn", "attention", "router",
                   "norms", "embeddings", "vision", "other")

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


# The checkpoint module names (PEFT-style) each fused or stacked model linear answers to:
# a checkpoint keeps a gated MLP's gate and up projections as two modules, and every
# routed expert as modules of its own.
MODULE_ALIASES = {
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),  # the dense MLP
    "shared_gate_up": ("gate_up", "shared_experts.gate_proj", "shared_experts.up_proj"),
    "experts":
        ("gate_up", "experts.*.gate_proj", "experts.*.up_proj", "experts.*.w1", "experts.*.w3"),
}


def _matches(name: str, pattern: str) -> bool:
  """PEFT's rule: a plain pattern names a module's last part; a dotted one its tail."""
  if "." not in pattern:
    return fnmatch.fnmatchcase(name.rsplit(".", 1)[-1], pattern)
  return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def lora_targets(lora: LoRAConfig | None, name: str) -> bool:
  """Whether the model linear named `name` gets an adapter under `lora.targets`: patterns
  name model linears ("q", "gate_up", "experts") or checkpoint modules ("q_proj",
  "kv_b_proj", "gate_proj", "experts.*.w1", "shared_experts.up_proj"); a fused linear is
  adapted whole when a pattern names either half."""
  if lora is None:
    return False
  if any(fnmatch.fnmatchcase(name, p) for p in lora.targets):  # the model's own name, whole
    return True
  return any(_matches(n, p) for p in lora.targets for n in MODULE_ALIASES.get(name, ()))


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

  work(cfg, n) -> [Work] for n tokens on one device (rows of train.seq_len);
  ops(cfg) -> the registered ops (hylora.ops.catalog) it calls."""

  name: str
  tensors: tuple[Tensor, ...]
  work: Callable[[Config, int], list[Work]]
  ops: Callable[[Config], tuple[str, ...]] = lambda cfg: ()


def _mixer_start(n: int, d: int, hd: int, lora: LoRAConfig | None, names) -> list[Work]:
  """A mixer's input (kept, normed) and its q, k, v projections of width hd."""
  work = [Work(sp.LAYER_INPUT, n * d * 2), _norm(sp.MIXER_NORM, n, d)]
  for name in names:
    work += frozen_linear(sp.QKV, n, d, hd, lora, name)
  return work


def _linear_attention_work(cfg: Config, n: int) -> list[Work]:
  m, lora = cfg.model, cfg.lora
  la, d = m.linear_attention, m.d_model
  hd = la.heads * la.head_dim
  work = _mixer_start(n, d, hd, lora, ("q", "k", "v"))
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


def _swiglu(n: int, d: int, ffn: int, lora: LoRAConfig | None, name: str = "gate_up") -> list[Work]:
  return (frozen_linear(sp.MLP_GATE_UP, n, d, 2 * ffn, lora, name) +
          frozen_linear(sp.MLP_DOWN, n, ffn, d, lora, "down"))


def _dense_ffn_work(cfg: Config, n: int) -> list[Work]:
  m = cfg.model
  return [_norm(sp.FFN_NORM, n, m.d_model)] + _swiglu(n, m.d_model, m.dense_ffn, cfg.lora)


def _routed_work(cfg: Config, n: int, width: int) -> list[Work]:
  """Router, routed experts of model width `width` and the shared experts."""
  m, lora = cfg.model, cfg.lora
  moe, d = m.moe, m.d_model
  f, pairs = moe.expert_ffn, n * moe.top_k
  computed = pairs
  if moe.dispatch == "ep_alltoall" and moe.capacity_factor > 0:
    # the experts compute every row of the capacity-sized receive buffers
    computed = math.ceil(pairs * max(1.0, moe.capacity_factor))
  padding = computed / pairs
  work = [
      Work(sp.ROUTER, n * moe.experts * 4, 2.0 * n * d * moe.experts, 2.0 * n * d * moe.experts),
      Work(sp.EXPERT_INPUT, computed * width * 2)
  ]
  gate_up = 2.0 * pairs * width * 2 * f
  work.append(Work(sp.EXPERT_GATE_UP, computed * 2 * f * 2, gate_up, gate_up, padding))
  if lora_targets(lora, "experts"):
    adapters = 2.0 * pairs * lora.rank * (width + 2 * f)
    work.append(Work(sp.EXPERT_GATE_UP, 0, adapters, 2.0 * adapters, padding))
  down = 2.0 * pairs * f * width
  work.append(Work(sp.EXPERT_DOWN, computed * width * 2, down, down, padding))
  if moe.shared_experts > 0:
    work += _swiglu(n, d, f * moe.shared_experts, lora, "shared_gate_up")
  return work


def _moe_work(cfg: Config, n: int) -> list[Work]:
  return [_norm(sp.FFN_NORM, n, cfg.model.d_model)] + _routed_work(cfg, n, cfg.model.d_model)


def _latent_moe_work(cfg: Config, n: int) -> list[Work]:
  d, latent = cfg.model.d_model, cfg.model.moe.latent_dim
  return ([_norm(sp.FFN_NORM, n, d)] + frozen_linear(sp.EXPERT_INPUT, n, d, latent, None, "") +
          _routed_work(cfg, n, latent) + [_norm(sp.EXPERT_DOWN, n, latent)] +
          frozen_linear(sp.EXPERT_DOWN, n, latent, d, None, ""))


def _kda_work(cfg: Config, n: int) -> list[Work]:
  m, lora = cfg.model, cfg.lora
  kda, d = m.kda, m.d_model
  hd = kda.heads * kda.head_dim
  work = _mixer_start(n, d, hd, lora, ("q_proj", "k_proj", "v_proj"))
  conv = 2.0 * n * 3 * hd * kda.conv_size  # three depthwise convolutions
  gate_rank = kda.output_gate_rank
  gates = 2.0 * n * (d * kda.gate_rank + kda.gate_rank * hd + d * kda.heads)
  gates += 2.0 * n * (d * gate_rank + gate_rank * hd if gate_rank else d * hd)
  # kept: the decay's gate projection (bf16; the op computes the decay from it), the
  # output gate before its sigmoid (bf16) and beta (fp32)
  work.append(Work(sp.GATES, n * hd * (2 + 2) + n * kda.heads * 4, gates + conv, gates + conv))
  c, h = kda.chunk_size, kda.head_dim
  core = float(n) * kda.heads * (5 * c * h + 6 * h * h)  # as the "linear" block's delta rule
  kept = 2 * (4 * h + 2 * c + h * h // c)
  work.append(Work(sp.ATTENTION, n * hd * 2 + n * kda.heads * kept, core, 2.0 * core))
  work += frozen_linear(sp.MIXER_OUT, n, hd, d, lora, "o_proj")
  return work


def _mla_work(cfg: Config, n: int) -> list[Work]:
  m, lora = cfg.model, cfg.lora
  mla, d, seq = m.mla, m.d_model, cfg.train.seq_len
  qk = mla.nope_dim + mla.rope_dim
  work = [Work(sp.LAYER_INPUT, n * d * 2), _norm(sp.MIXER_NORM, n, d)]
  if mla.q_rank:
    work += frozen_linear(sp.QKV, n, d, mla.q_rank, lora, "q_a_proj")
    work += frozen_linear(sp.QKV, n, mla.q_rank, mla.heads * qk, lora, "q_b_proj")
  else:
    work += frozen_linear(sp.QKV, n, d, mla.heads * qk, lora, "q_proj")
  work += frozen_linear(sp.QKV, n, d, mla.kv_rank + mla.rope_dim, lora, "kv_a_proj_with_mqa")
  work += frozen_linear(sp.QKV, n, mla.kv_rank, mla.heads * (mla.nope_dim + mla.v_dim), lora,
                        "kv_b_proj")
  keys = seq / 2  # causal: half the row on average
  if mla.index_topk:
    ih, ihd = mla.index_heads, mla.index_head_dim
    work.append(
        Work(sp.INDEXER, n * (ih * ihd * 2 + ihd * 2 + ih * 4),
             2.0 * n * (mla.q_rank * ih * ihd + d * ihd + d * ih)))
    work.append(Work(sp.TOPK, n * mla.index_topk * 4, float(n) * seq * ih * ihd))
    keys = min(mla.index_topk, keys)
  core = 2.0 * n * mla.heads * keys * (qk + mla.v_dim)
  kept = n * mla.heads * (mla.v_dim * 2 + 4)  # the output and the log-sum-exp
  if not mla.index_topk and cfg.kernels.causal_attention in ("auto", "cudnn"):
    # cuDNN on GPU takes packed documents as a [B, 1, T, T] boolean mask and keeps the bf16
    # bias it makes of it (pallas_kernels/causal_attention/cudnn.py)
    kept += n * seq * 3
  work.append(Work(sp.ATTENTION, kept, core, 2.0 * core))
  if mla.output_gate:
    work += frozen_linear(sp.GATES, n, d, mla.heads * mla.v_dim, None, "")
  work += frozen_linear(sp.MIXER_OUT, n, mla.heads * mla.v_dim, d, lora, "o_proj")
  return work


_ATTENTION_PROJECTIONS = (
    _linear("mixer/q/kernel", "attention"),
    _linear("mixer/k/kernel", "attention"),
    _linear("mixer/v/kernel", "attention"),
    _linear("mixer/o/kernel", "attention", in_dims=2),
)


def _swiglu_tensors(module: str, kind: str) -> tuple[Tensor, ...]:
  return (_linear(f"{module}/gate_up/kernel", kind), _linear(f"{module}/down/kernel", kind))


_SPARSE_OPS = ("sparse_attention.topk_indices", "sparse_attention.attend")
_EXPERT_OPS = ("grouped_matmul", "grouped_lora")

MIXER_BLOCKS: dict[str, Block] = {
    # Chunked linear attention (GLA / KDA): low-rank decay gate, output gate, delta-rule
    # beta, a per-head output norm.
    "linear":
        Block(
            "linear", _ATTENTION_PROJECTIONS + (
                _linear("mixer/decay_down/kernel", "attention"),
                _linear("mixer/decay_up/kernel", "attention"),
                _linear("mixer/out_gate_down/kernel", "attention"),
                _linear("mixer/out_gate_up/kernel", "attention"),
                _linear("mixer/beta/kernel", "attention"),
                Tensor("mixer/head_norm", "norms"),
            ), _linear_attention_work, lambda cfg:
            ("linear_attention.kda"
             if cfg.model.linear_attention.delta_rule else "linear_attention.gla",)),
    # Top-K sparse attention and its indexer.
    "sparse":
        Block(
            "sparse", _ATTENTION_PROJECTIONS + (
                _linear("mixer/index_q_down/kernel", "attention"),
                _linear("mixer/index_q_up/kernel", "attention"),
                _linear("mixer/index_k/kernel", "attention"),
                _linear("mixer/index_w/kernel", "attention"),
            ), _sparse_attention_work, lambda cfg: _SPARSE_OPS),
    # Kimi Delta Attention as released (Kimi Linear, K3): short convolutions, the A_log /
    # dt_bias decay, beta, a gated output norm; low-rank or full-rank output gate.
    "kda":
        Block("kda", (
            _linear("mixer/q_proj/kernel", "attention"),
            _linear("mixer/k_proj/kernel", "attention"),
            _linear("mixer/v_proj/kernel", "attention"),
            _linear("mixer/o_proj/kernel", "attention", in_dims=2),
            Tensor("mixer/q_conv", "attention", disk="conv1d"),
            Tensor("mixer/k_conv", "attention", disk="conv1d"),
            Tensor("mixer/v_conv", "attention", disk="conv1d"),
            _linear("mixer/f_a_proj/kernel", "attention"),
            _linear("mixer/f_b_proj/kernel", "attention"),
            Tensor("mixer/dt_bias", "attention", disk="flat"),
            Tensor("mixer/A_log", "attention", disk="heads_4d"),
            _linear("mixer/b_proj/kernel", "attention"),
            _linear("mixer/g_a_proj/kernel", "attention"),
            _linear("mixer/g_b_proj/kernel", "attention"),
            _linear("mixer/g_proj/kernel", "attention"),
            Tensor("mixer/o_norm", "norms"),
        ), _kda_work, lambda cfg: ("short_conv", "linear_attention.kda")),
    # Multi-head latent attention (Kimi Linear, DeepSeek-V3.2, K3), with DeepSeek-V3.2's
    # sparse-attention indexer and K3's output gate where configured.
    "mla":
        Block("mla", (
            _linear("mixer/q_proj/kernel", "attention"),
            _linear("mixer/q_a_proj/kernel", "attention"),
            Tensor("mixer/q_a_layernorm", "norms"),
            _linear("mixer/q_b_proj/kernel", "attention"),
            _linear("mixer/kv_a_proj_with_mqa/kernel", "attention"),
            Tensor("mixer/kv_a_layernorm", "norms"),
            _linear("mixer/kv_b_proj/kernel", "attention"),
            _linear("mixer/o_proj/kernel", "attention", in_dims=2),
            _linear("mixer/g_proj/kernel", "attention"),
            _linear("mixer/indexer/wq_b/kernel", "attention"),
            _linear("mixer/indexer/wk/kernel", "attention"),
            Tensor("mixer/indexer/k_norm_scale", "norms"),
            Tensor("mixer/indexer/k_norm_bias", "norms"),
            _linear("mixer/indexer/weights_proj/kernel", "attention"),
        ), _mla_work, lambda cfg: _SPARSE_OPS
              if cfg.model.mla.index_topk > 0 else ("attention.causal",)),
}

_ROUTED_TENSORS = (
    _linear("ffn/router/kernel", "router", adapter=False),
    Tensor("ffn/router/bias", "router", optional=True),
    # The slot -> expert table (hylora.model.ffn.placement) has no checkpoint tensor:
    # checkpoints store experts in logical order, so loading starts from the initial placement.
    Tensor("ffn/placement", "other", fill="expert_ids"),
    Tensor("ffn/experts/gate_up", "experts", linear=True, per_expert=True, adapter="ffn/experts"),
    Tensor("ffn/experts/down", "experts", linear=True, per_expert=True),
) + _swiglu_tensors("ffn/shared", "shared_experts")

FFN_BLOCKS: dict[str, Block] = {
    # The first `dense_layers` layers.
    "dense":
        Block("dense", _swiglu_tensors("ffn/mlp", "dense_ffn"), _dense_ffn_work),
    # Router, routed experts (stacked along the expert axis), shared experts.
    "moe":
        Block("moe", _ROUTED_TENSORS, _moe_work, lambda cfg: _EXPERT_OPS),
    # K3's latent MoE: the routed experts run on a narrower projection of the token.
    "latent_moe":
        Block(
            "latent_moe", _ROUTED_TENSORS + (
                _linear("ffn/routed_expert_down_proj/kernel", "expert_latent", adapter=False),
                Tensor("ffn/routed_expert_norm/scale", "norms"),
                _linear("ffn/routed_expert_up_proj/kernel", "expert_latent", adapter=False),
            ), _latent_moe_work, lambda cfg: _EXPERT_OPS),
}

# Every decoder layer's own tensors, whatever its blocks.
LAYER_TENSORS: tuple[Tensor, ...] = (
    Tensor("mixer_norm/scale", "norms"),
    Tensor("ffn_norm/scale", "norms"),
    # "depth_mix" residual: the block input's mixing weights (trainable, not frozen)
    Tensor("residual/weights", "other"),
    # "block_attention" residual (K3's Attention Residuals): per read, a norm and a query
    Tensor("residual/mixer_norm", "norms"),
    Tensor("residual/mixer_query", "other", disk="row"),
    Tensor("residual/ffn_norm", "norms"),
    Tensor("residual/ffn_query", "other", disk="row"),
)

# Tensors outside the decoder layers (paths from the model's root).
MODEL_TENSORS: tuple[Tensor, ...] = (
    Tensor("embed", "embeddings"),
    Tensor("final_norm/scale", "norms"),
    Tensor("lm_head", "embeddings", linear=True),
    Tensor("output_residual/norm", "norms"),
    Tensor("output_residual/query", "other", disk="row"),
)

# The vision tower's tensors keep the model's own layout under `vision/` (hylora.io.hf_names).
VISION_ROOT = "vision"


def mixer_block(kind: str) -> Block:
  if kind not in MIXER_BLOCKS:
    raise ConfigError(f"model.pattern: no layer kind {kind!r}; known mixers: "
                      f"{sorted(MIXER_BLOCKS)}")
  return MIXER_BLOCKS[kind]


def model_ops(cfg: Config) -> tuple[str, ...]:
  """Every registered op the model's layers call, and the loss's (sorted)."""
  ops = {"cross_entropy"}
  if cfg.model.residual == "depth_mix":
    ops.add("residual_mix")
  for mixer, ffn in cfg.model.layer_kinds():
    ops.update(mixer_block(mixer).ops(cfg))
    ops.update(ffn_block(ffn).ops(cfg))
  return tuple(sorted(ops))


def ffn_block(kind: str) -> Block:
  if kind not in FFN_BLOCKS:
    raise ConfigError(f"FFN kind {kind!r} is not described; known: {sorted(FFN_BLOCKS)}")
  return FFN_BLOCKS[kind]


# ---- the layer plan ---------------------------------------------------------------------


def plan_segments(kinds: list[tuple[str, str]], period: int, boundary: int | None = None):
  """[(period kinds, repeats)] covering `kinds` in order: consecutive identical periods
  of `period` layers form one segment (stacked and scanned by hylora.model.stack).

  `boundary` (the "block_attention" residual's block size): every layer whose index is a
  multiple of it starts a segment, so that the stream's completed blocks only change
  between scans (hylora.model.residual). The layers are cut at those indices first, then
  each stretch is cut into periods from its own first layer, its remainder a shorter last
  period. When the block size is a multiple of `period` these are the model's own periods;
  otherwise they are rotations of the pattern (any run of layer kinds is a valid period),
  still merged where they repeat inside a stretch."""
  step = boundary or len(kinds) or 1
  plan: list[tuple[tuple, int]] = []
  for stretch in range(0, len(kinds), step):
    end = min(stretch + step, len(kinds))
    segments: list[list] = []
    for start in range(stretch, end, period):
      chunk = tuple(kinds[start:min(start + period, end)])
      if segments and segments[-1][0] == chunk:
        segments[-1][1] += 1
      else:
        segments.append([chunk, 1])
    plan += [(chunk, repeats) for chunk, repeats in segments]
  return plan


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


def model_segments(m: ModelConfig):
  """The model's segments (`plan_segments`): runs of identical layer periods, ended at
  every block of the "block_attention" residual (its completed blocks are constants of a
  segment's scan, hylora.model.stack)."""
  boundary = m.residual_block if m.residual == "block_attention" else None
  return plan_segments(m.layer_kinds(), len(m.pattern), boundary)


def layer_plans(m: ModelConfig) -> list[LayerPlan]:
  """Every decoder layer in order; an undescribed kind is a ConfigError."""
  plans, index = [], 0
  segments = model_segments(m)
  for segment, (chunk, repeats) in enumerate(segments):
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

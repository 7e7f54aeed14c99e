"""The one name-mapping table between the model's parameters and the tensor names of a
Hugging Face-layout checkpoint (safetensors), and its expansion over a config.

Model parameters are leaves of the pure-dict pytrees of `hylora.train.state` (paths
joined with "/"). Decoder-layer leaves live under
`stack/segments/<s>/periods/layers/<i>/...` with a leading `layers` axis (the scanned
repeats of a segment, hylora.model.stack); routed-expert leaves then carry the expert
axis. In the checkpoint every layer and every expert is a tensor of its own:
`model.layers.<global layer>.<name>`, with `<e>` the expert index. The model stores
experts by slot (hylora.model.ffn.placement): on loading, slot s takes expert s mod E
(the initial placement); on writing, each expert comes from its first slot.

Layouts:
  same    the tensor has the model leaf's shape (norm scales, embedding, biases);
  linear  a torch `nn.Linear` weight `[out, in]`: the model kernel `[*in, *out]` is its
          transpose, reshaped (heads stay major: q_proj `[heads * head_dim, d]`);
  fused   (several names) linear weights stacked along `out`: the model's fused
          `gate_up` kernel `[d, 2f]` is `gate_proj` (first f columns) then `up_proj`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import jax

from hylora.core.config import Config
from hylora.core.errors import ConfigError

LAYER_PREFIX = "model.layers.{layer}."


@dataclasses.dataclass(frozen=True)
class Rule:
  model: str  # leaf path inside a decoder layer, or inside the model for MODEL_RULES
  names: tuple[str, ...]  # checkpoint name(s); several: fused along the output dimension
  linear: bool = False  # torch Linear layout [out, in]
  in_dims: int = 1  # how many leading dims of the model kernel form `in`
  per_expert: bool = False  # one tensor per routed expert ("{e}" in the names)
  optional: bool = False  # may be absent: loaded as zeros
  adapter: str | None = None  # module holding lora_a / lora_b for this weight (PEFT export)
  fill: str | None = None  # no checkpoint tensor: "expert_ids" = the initial expert placement


def _linear(model, *names, in_dims=1, adapter=True):
  """A Linear module's kernel; its adapter (if any) sits next to the kernel."""
  module = model.rsplit("/", 1)[0]
  return Rule(model, names, linear=True, in_dims=in_dims, adapter=module if adapter else None)


# THE TABLE. Decoder-layer leaves (names relative to `model.layers.<i>.`):
LAYER_RULES: tuple[Rule, ...] = (
    Rule("mixer_norm/scale", ("input_layernorm.weight",)),
    Rule("ffn_norm/scale", ("post_attention_layernorm.weight",)),
    # attention projections (linear and sparse layers alike)
    _linear("mixer/q/kernel", "self_attn.q_proj.weight"),
    _linear("mixer/k/kernel", "self_attn.k_proj.weight"),
    _linear("mixer/v/kernel", "self_attn.v_proj.weight"),
    _linear("mixer/o/kernel", "self_attn.o_proj.weight", in_dims=2),
    # linear attention: low-rank decay gate (f), output gate (g), delta-rule beta (b)
    _linear("mixer/decay_down/kernel", "self_attn.f_a_proj.weight"),
    _linear("mixer/decay_up/kernel", "self_attn.f_b_proj.weight"),
    _linear("mixer/out_gate_down/kernel", "self_attn.g_a_proj.weight"),
    _linear("mixer/out_gate_up/kernel", "self_attn.g_b_proj.weight"),
    _linear("mixer/beta/kernel", "self_attn.b_proj.weight"),
    Rule("mixer/head_norm", ("self_attn.o_norm.weight",)),
    # sparse attention: the top-k indexer
    _linear("mixer/index_q_down/kernel", "self_attn.indexer.q_a_proj.weight"),
    _linear("mixer/index_q_up/kernel", "self_attn.indexer.q_b_proj.weight"),
    _linear("mixer/index_k/kernel", "self_attn.indexer.k_proj.weight"),
    _linear("mixer/index_w/kernel", "self_attn.indexer.weights_proj.weight"),
    # dense FFN (first `dense_layers` layers)
    _linear("ffn/mlp/gate_up/kernel", "mlp.gate_proj.weight", "mlp.up_proj.weight"),
    _linear("ffn/mlp/down/kernel", "mlp.down_proj.weight"),
    # MoE: router, routed experts (stacked along the expert axis), shared experts
    _linear("ffn/router/kernel", "mlp.gate.weight", adapter=False),
    Rule("ffn/router/bias", ("mlp.gate.e_score_correction_bias",), optional=True),
    # slot -> expert table (hylora.model.ffn.placement): checkpoints store experts in
    # logical order, so loading starts from the initial placement
    Rule("ffn/placement", (), fill="expert_ids"),
    Rule("ffn/experts/gate_up", ("mlp.experts.{e}.gate_proj.weight",
                                 "mlp.experts.{e}.up_proj.weight"),
         linear=True, per_expert=True, adapter="ffn/experts"),
    Rule("ffn/experts/down", ("mlp.experts.{e}.down_proj.weight",), linear=True,
         per_expert=True),
    _linear("ffn/shared/gate_up/kernel", "mlp.shared_experts.gate_proj.weight",
            "mlp.shared_experts.up_proj.weight"),
    _linear("ffn/shared/down/kernel", "mlp.shared_experts.down_proj.weight"),
    # "depth_mix" residual: the block input's mixing weights (trainable, not frozen)
    Rule("residual/weights", ("residual_mix.weight",)),
)

# Leaves outside the decoder layers (absolute names).
MODEL_RULES: tuple[Rule, ...] = (
    Rule("embed", ("model.embed_tokens.weight",)),
    Rule("final_norm/scale", ("model.norm.weight",)),
    Rule("lm_head", ("lm_head.weight",), linear=True, adapter=None),
)

# The vision tower keeps its own layout: `vision/<path>` is `vision_tower.<path>` with "/"
# read as "."; its stacked encoder blocks are split into `blocks.<i>`.
VISION_PREFIX = ("vision/", "vision_tower.")
VISION_STACK = "vision/encoder/blocks/"

_STACK_PREFIX = ("stack", "segments")


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One model leaf and the checkpoint tensors that make it up."""

  path: tuple  # pure-dict key path
  rule: Rule
  shape: tuple[int, ...]
  dtype: object
  layers: tuple[int, ...] | None  # global layer index of each entry of the stacked axis
  name_template: tuple[str, ...]  # full names with "{layer}" / "{e}" placeholders
  experts: int = 0  # size of the expert (slot) axis (per-expert rules)
  routed: int = 0  # routed experts of the model: slot s starts as expert s mod routed

  @property
  def key(self) -> str:
    return "/".join(map(str, self.path))

  @property
  def stack_dims(self) -> int:
    return (self.layers is not None) + (self.experts > 0)

  @property
  def item_shape(self) -> tuple[int, ...]:
    """The shape of one layer's (one expert's) slice in the model's layout."""
    return self.shape[self.stack_dims:]

  def items(self) -> Iterator[tuple[tuple[int, ...], tuple[str, ...]]]:
    """(stack index, checkpoint names) for every layer / expert slice of the leaf."""
    repeats = range(len(self.layers)) if self.layers is not None else [None]
    experts = range(self.routed) if self.experts else [None]  # each expert once
    for r in repeats:
      for e in experts:
        index = tuple(i for i in (r, e) if i is not None)
        yield index, self.names_at(index)

  def names_at(self, index: tuple[int, ...]) -> tuple[str, ...]:
    fill = {}
    if self.layers is not None:
      fill["layer"] = self.layers[index[0]]
    if self.experts:
      fill["e"] = index[-1] % self.routed
    return tuple(t.format(**fill) for t in self.name_template)

  def tensor_shape(self) -> tuple[int, ...]:
    """The shape each checkpoint tensor of one slice must have."""
    item, rule = self.item_shape, self.rule
    if not rule.linear:
      return item
    n_in = math.prod(item[:rule.in_dims])
    n_out = math.prod(item[rule.in_dims:])
    return (n_out // len(rule.names), n_in)


def _layer_starts(cfg: Config) -> list[int]:
  from hylora.model.stack import plan_segments

  starts, first = [], 0
  for chunk, repeats in plan_segments(cfg.model.layer_kinds(), len(cfg.model.pattern)):
    starts.append((first, len(chunk)))
    first += len(chunk) * repeats
  return starts


def _rule_index(rules) -> dict[str, Rule]:
  return {r.model: r for r in rules}


_LAYER = _rule_index(LAYER_RULES)
_MODEL = _rule_index(MODEL_RULES)


def plan(cfg: Config, tree: dict) -> list[Leaf]:
  """A `Leaf` for every leaf of a pure-dict tree of arrays / ShapeDtypeStructs."""
  starts = _layer_starts(cfg)
  leaves = []
  for key_path, value in jax.tree_util.tree_flatten_with_path(tree)[0]:
    path = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in key_path)
    leaves.append(_leaf(cfg, path, tuple(value.shape), value.dtype, starts))
  return leaves


def _leaf(cfg: Config, path: tuple, shape, dtype, starts) -> Leaf:
  joined = "/".join(map(str, path))
  if path[:2] == _STACK_PREFIX and len(path) > 6 and path[3:5] == ("periods", "layers"):
    segment, position, rel = path[2], path[5], "/".join(map(str, path[6:]))
    rule = _LAYER.get(rel)
    if rule is None:
      raise ConfigError(f"model parameter {joined}: no checkpoint name in the table of "
                        "hylora.io.hf_names (LAYER_RULES); add one")
    first, period = starts[segment]
    layers = tuple(first + r * period + position for r in range(shape[0]))
    experts = shape[1] if rule.per_expert else 0
    names = tuple(LAYER_PREFIX + n for n in rule.names)
    return Leaf(path, rule, shape, dtype, layers, names, experts, cfg.model.moe.experts)
  if joined in _MODEL:
    return Leaf(path, _MODEL[joined], shape, dtype, None, _MODEL[joined].names)
  if joined.startswith(VISION_PREFIX[0]):
    rest = joined[len(VISION_PREFIX[0]):].replace("/", ".")
    adapter = joined.rsplit("/", 1)[0] if joined.endswith("/kernel") else None
    rule = Rule(joined, (VISION_PREFIX[1] + rest,), adapter=adapter)
    if joined.startswith(VISION_STACK):
      tail = joined[len(VISION_STACK):].replace("/", ".")
      stem = VISION_STACK[len(VISION_PREFIX[0]):].replace("/", ".")
      name = f"{VISION_PREFIX[1]}{stem}{{layer}}.{tail}"
      return Leaf(path, rule, shape, dtype, tuple(range(shape[0])), (name,))
    return Leaf(path, rule, shape, dtype, None, rule.names)
  raise ConfigError(f"model parameter {joined}: no checkpoint name in the table of "
                    "hylora.io.hf_names (MODEL_RULES); add one")


"""The architecture's description against the model it describes: every parameter the
model builds is described (path, kind, checkpoint names) and every described tensor
exists; the layer plan places each layer; FLOPs follow the frozen-weight rules."""

import dataclasses

import jax
import pytest
from flax import nnx

from hylora.core import architecture as arch
from hylora.core import save_points
from hylora.core.config import LoRAConfig
from hylora.core.errors import ConfigError
from hylora.model import HybridLM, LoRAParam
from hylora.model.ffn import FFNS
from hylora.model.init import ParamInit
from hylora.model.mixers import MIXERS
from hylora.plan.param_count import path_keys
from tests.helpers import fixture_config, released_config, small_config, tiny_k3_config


def _everything_config():
  """Both mixers, both FFNs, shared experts, the depth-mix residual, no vision."""
  cfg = small_config()
  model = dataclasses.replace(cfg.model, residual="depth_mix",
                              vision=dataclasses.replace(cfg.model.vision, enabled=False))
  return dataclasses.replace(cfg, model=model)


def _leaf_keys(cfg):
  model = nnx.eval_shape(lambda: HybridLM(cfg.model, cfg.lora, init=ParamInit(0)))
  _, lora, frozen = nnx.split(model, LoRAParam, ...)
  leaves = []
  for tree in (lora, frozen):
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(tree))[0]
    leaves += [path_keys(path) for path, _ in flat]
  return leaves


def _configs_with_every_block():
  """The house blocks, and the released families' (with K3's variants)."""
  return [
      _everything_config(),
      released_config(fixture_config("kimi_linear")),
      released_config(fixture_config("deepseek_v32")),
      released_config(tiny_k3_config()),
  ]


def test_the_model_and_its_description_hold_the_same_tensors():
  described_paths = {t.path for t in arch.ALL_LAYER_TENSORS}
  seen = set()
  for cfg in _configs_with_every_block():
    for keys in _leaf_keys(cfg):
      stacked = arch.stacked_position(keys)
      if stacked is None:
        assert arch.tensor_at("/".join(keys), arch.MODEL_TENSORS) is not None, keys
        continue
      tensor = arch.tensor_at(stacked[2], arch.ALL_LAYER_TENSORS)
      assert tensor is not None, f"{'/'.join(keys)} is not described"
      seen.add(tensor.path)
  assert seen == described_paths  # nothing described that no model builds


def test_blocks_and_modules_name_the_same_kinds():
  assert set(arch.MIXER_BLOCKS) == set(MIXERS)
  assert set(arch.FFN_BLOCKS) == set(FFNS)


def test_layer_plan_places_every_layer_in_its_segment():
  m = small_config().model  # L L L S, first layer dense
  plans = arch.layer_plans(m)
  assert [(p.mixer, p.ffn) for p in plans] == m.layer_kinds()
  deep = dataclasses.replace(m, layers=12, dense_layers=4)
  plans = arch.layer_plans(deep)
  assert [p.segment for p in plans] == [0] * 4 + [1] * 8  # dense period, then 2 x MoE
  assert arch.stacked_layers(deep, 1, 3) == (7, 11)
  assert arch.stacked_position(("stack", "segments", 1, "periods", "layers", 3, "ffn", "router",
                                "kernel")) == (1, 3, "ffn/router/kernel")
  assert arch.stacked_position(("embed",)) is None


def test_an_undescribed_layer_kind_is_an_error_not_a_guess():
  m = dataclasses.replace(small_config().model, pattern=("linear", "conv"))
  with pytest.raises(ConfigError, match="no layer kind 'conv'"):
    arch.layer_plans(m)
  with pytest.raises(ConfigError, match="model.pattern"):
    dataclasses.replace(small_config(), model=m).validate()


def test_parameter_kinds_follow_the_description():
  kind = arch.parameter_kind
  layer = ("stack", "segments", 0, "periods", "layers", 2)
  assert kind(layer + ("mixer", "q", "kernel")) == "attention"
  assert kind(layer + ("mixer", "q", "lora_a")) == "attention"
  assert kind(layer + ("ffn", "experts", "lora_b")) == "experts"
  assert kind(layer + ("ffn", "shared", "down", "kernel")) == "shared_experts"
  assert kind(layer + ("mixer", "head_norm")) == "norms"
  assert kind(("lm_head",)) == "embeddings"
  assert kind(("vision", "encoder", "blocks", "q", "kernel")) == "vision"


def test_frozen_linears_backward_is_their_input_gradient_and_adapters_twice_forward():
  cfg = small_config()
  no_lora = dataclasses.replace(cfg, lora=LoRAConfig(targets=()))
  n, d, f = 100, cfg.model.d_model, cfg.model.dense_ffn
  work = arch.FFN_BLOCKS["dense"].work(no_lora, n)
  frozen = [w for w in work if w.save_point in (save_points.MLP_GATE_UP, save_points.MLP_DOWN)]
  assert sum(w.forward for w in frozen) == 2.0 * n * d * 2 * f + 2.0 * n * f * d
  assert all(w.backward == w.forward for w in frozen)
  adapters = [
      w for w in arch.FFN_BLOCKS["dense"].work(cfg, n) if w.save_point == save_points.LORA_A
  ]
  assert adapters and all(w.backward == 2 * w.forward for w in adapters)
  indexer = [
      w for w in arch.MIXER_BLOCKS["sparse"].work(cfg, n)
      if w.save_point in (save_points.INDEXER, save_points.TOPK)
  ]
  assert indexer and all(w.backward == 0 for w in indexer)


def test_step_flops_add_up_the_layers():
  cfg = small_config()
  flops = arch.step_flops(cfg)
  tokens = cfg.train.batch_size * cfg.train.seq_len
  per_layer = {}
  for plan in arch.layer_plans(cfg.model):
    for block in plan.blocks:
      per_layer[block.name] = per_layer.get(block.name, 0.0) + sum(
          w.forward + w.backward for w in block.work(cfg, tokens))
  assert {k: v for k, v in flops.items() if k != "lm_head"} == per_layer
  assert flops["lm_head"] == 4.0 * tokens * cfg.model.d_model * cfg.model.vocab_size

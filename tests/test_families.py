"""Released families' config.json read into the model config: layer kinds from the
1-based lists, every size, the full-size presets and their parameter counts."""

import dataclasses

import pytest

from hylora.core import families
from hylora.core.config import ModelConfig
from hylora.core.errors import ConfigError
from hylora.core.presets import get_preset


def test_kimi_linear_layer_lists_are_one_based():
  m = families.architecture(families.published("kimi-linear"), ModelConfig())
  kinds = [mixer for mixer, _ in m.layer_kinds()]
  assert [i + 1 for i, k in enumerate(kinds) if k == "mla"] == [4, 8, 12, 16, 20, 24, 27]
  assert m.layer_kinds()[0] == ("kda", "dense") and m.layer_kinds()[1] == ("kda", "moe")
  assert (m.kda.heads, m.kda.head_dim, m.kda.conv_size, m.kda.output_gate_rank) == (32, 128, 4, 128)
  assert (m.mla.q_rank, m.mla.kv_rank, m.mla.rope) == (0, 512, False)
  assert (m.moe.experts, m.moe.top_k, m.moe.routed_scale, m.moe.shared_experts) == (256, 8, 2.446,
                                                                                    1)


def test_deepseek_v32_reads_yarn_groups_and_the_indexer():
  m = families.architecture(families.published("deepseek-v3.2"), ModelConfig())
  assert m.dense_layers == 3 and m.layers == 61 and m.family == "deepseek_v32"
  assert (m.mla.yarn_factor, m.mla.yarn_mscale_all_dim, m.mla.rope) == (40.0, 1.0, True)
  assert (m.mla.index_topk, m.mla.index_heads, m.mla.index_head_dim) == (2048, 64, 128)
  assert (m.moe.groups, m.moe.groups_kept) == (8, 4)
  assert families.ignored_tensors(
      families.published("deepseek-v3.2")) == (r"^model\.layers\.(61)\.",)


def test_kimi_k3_reads_its_text_config():
  m = families.architecture(families.published("kimi-k3"), ModelConfig())
  kinds = [mixer for mixer, _ in m.layer_kinds()]
  assert kinds.count("kda") == 69 and kinds.count("mla") == 24
  assert (m.ffn, m.moe.latent_dim, m.moe.experts, m.moe.top_k) == ("latent_moe", 3584, 896, 16)
  assert (m.activation, m.residual, m.residual_block) == ("situ", "block_attention", 12)
  assert (m.kda.output_gate_rank, m.kda.gate_lower_bound, m.mla.output_gate) == (0, -5.0, True)


def test_run_choices_survive_a_checkpoint_config():
  run = dataclasses.replace(ModelConfig(), weight_dtype="float32")
  run = dataclasses.replace(run, moe=dataclasses.replace(run.moe, dispatch="ep_alltoall"))
  m = families.architecture(families.published("kimi-linear"), run)
  assert m.weight_dtype == "float32" and m.moe.dispatch == "ep_alltoall"


def test_unsupported_model_type_names_the_supported_ones():
  with pytest.raises(ConfigError, match="supported: deepseek_v32, kimi_k3, kimi_linear"):
    families.architecture({"model_type": "llama"}, ModelConfig())


@pytest.mark.parametrize("name", ["kimi-linear", "deepseek-v3.2", "kimi-k3"])
def test_released_presets_validate(name):
  cfg = get_preset(name).validate()
  assert cfg.lora.rank == 16 and "kv_b_proj" in cfg.lora.targets


@pytest.mark.parametrize(
    "name, total, active, tolerance",
    [
        ("kimi-k3", 2.8e12, 104e9, 0.01),  # "2.8T total / 104B active"
        ("deepseek-v3.2", 671e9, 37e9, 0.015),  # "671B / 37B activated" (MTP layer apart)
        ("kimi-linear", 48e9, 3e9, 0.05),  # "48B-A3B": rounded in the name
    ])
def test_released_presets_count_as_published(name, total, active, tolerance):
  """Every block's size comes from the published config alone."""
  from hylora.plan.param_count import count_params
  from hylora.train import state as st
  cfg = get_preset(name)
  lora, frozen = st.abstract_arrays(st.model_parts(cfg))
  counts = count_params(cfg, lora, frozen)
  assert abs(counts["total"] / total - 1) < tolerance, counts["total"]
  assert abs(counts["active"] / active - 1) < tolerance, counts["active"]

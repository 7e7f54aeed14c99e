import pytest

from experiments.lora_2p8t import main
from hylora.core.config import Config
from hylora.core.errors import ConfigError
from hylora.core.overrides import apply_overrides, from_dict, split_overrides, to_dict
from hylora.core.presets import PRESETS, get_preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate_and_round_trip(name):
  cfg = get_preset(name).validate()
  assert from_dict(Config, to_dict(cfg)) == cfg


def test_2p8t_preset_is_the_target():
  m = get_preset("2p8t").model
  assert (m.d_model, m.layers, m.dense_layers, m.vocab_size) == (7168, 72, 2, 163840)
  assert [k for k, _ in m.layer_kinds()].count("linear") == 54
  assert (m.moe.experts, m.moe.top_k, m.moe.expert_ffn, m.moe.shared_experts) == (896, 16, 2048, 1)
  assert m.sparse_attention.top_k == 2048


def test_overrides_parse_types():
  overrides, rest = split_overrides([
      "--model.moe.top_k=4", "--lora.targets", "q,v", "--train.learning_rate=1e-3", "--steps", "3",
      "--model.linear_attention.delta_rule=false"
  ])
  cfg = apply_overrides(get_preset("tiny"), overrides)
  assert cfg.model.moe.top_k == 4 and cfg.lora.targets == ("q", "v")
  assert cfg.train.learning_rate == 1e-3 and cfg.model.linear_attention.delta_rule is False
  assert rest == ["--steps", "3"]


def test_unknown_override_names_the_field():
  with pytest.raises(ConfigError, match="unknown config field 'model.topk'"):
    apply_overrides(get_preset("tiny"), {"model.topk": "3"})


def test_bad_value_names_the_field():
  with pytest.raises(ConfigError, match="model.moe.top_k: cannot parse 'many'"):
    apply_overrides(get_preset("tiny"), {"model.moe.top_k": "many"})


def test_unknown_preset():
  with pytest.raises(ConfigError, match="unknown preset 'huge'"):
    get_preset("huge")


@pytest.mark.parametrize("changes, field", [
    ({
        "model.moe.top_k": "9"
    }, "model.moe.top_k"),
    ({
        "train.seq_len": "100"
    }, "train.seq_len"),
    ({
        "train.grad_accum": "3"
    }, "train.batch_size"),
    ({
        "model.pattern": "linear,global"
    }, "model.pattern"),
    ({
        "memory.remat": "some"
    }, "memory.remat"),
    ({
        "model.moe.spare_slots": "-1"
    }, "model.moe.spare_slots"),
    ({
        "model.moe.rebalance_every": "-2"
    }, "model.moe.rebalance_every"),
    ({
        "model.moe.bias_update_every": "1",
        "model.moe.bias_update_rate": "0"
    }, "model.moe.bias_update_rate"),
    ({
        "model.moe.dispatch": "bogus"
    }, "model.moe.dispatch: unknown dispatcher 'bogus'; choose one of"),
    ({
        "model.moe.round_capacity": "0"
    }, "model.moe.round_capacity"),
    ({
        "kernels.grouped_matmul": "bogus"
    }, r"kernels.grouped_matmul: unknown implementation 'bogus'; choose one of \['auto', "),
    ({
        "kernels.linear_attention": "loop"
    }, "kernels.linear_attention: unknown implementation 'loop'"),
    ({
        "memory.device_memory": "0"
    }, "memory.device_memory"),
])
def test_validate_names_the_field(changes, field):
  from hylora.plan.run_plan import check_choices
  with pytest.raises(ConfigError, match=field):
    check_choices(apply_overrides(get_preset("tiny"), changes).validate())


def test_cli_help_lists_every_field(capsys):
  with pytest.raises(SystemExit) as exit_info:
    main(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  for name in ("--model.moe.experts=8", "--lora.rank=4", "--mesh.expert=4",
               "--kernels.linear_attention=auto", "--memory.remat=auto", "--train.steps=40"):
    assert name in out


@pytest.mark.parametrize("argv, message", [
    (["--preset", "huge"], "unknown preset"),
    (["--model.nope=1"], "unknown config field 'model.nope'"),
    (["--model.moe.top_k=x"], "model.moe.top_k: cannot parse"),
    (["--model.moe.dispatch=bogus"], "model.moe.dispatch: unknown dispatcher 'bogus'"),
    (["--kernels.grouped_matmul=bogus"], "kernels.grouped_matmul: unknown implementation"),
    (["--distributed-timeout", "0"], "--distributed-timeout: must be >= 1 s"),
    (["--device-memory", "lots"], "--device-memory: expected a positive size"),
])
def test_cli_bad_input_is_one_clear_line(argv, message, capsys):
  assert main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error:") and message in err and "Traceback" not in err

"""experiments.profile_part: instruction -> source op and phase mapping, and a CPU run."""

import os

from experiments import profile_part

TEXT = """ENTRY %main {
  %fusion.5 = (f32[8]{0}, f32[8]{0}) fusion(%a), kind=kLoop, metadata={op_name="jit(loss)/jvp()/Block/LinearAttention/mul" source_file="x.py"}
  %custom-call.2 = bf16[8,8]{1,0} custom-call(%b), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(loss)/transpose(jvp())/pallas_call"}
  ROOT %x = f32[2]{0} add(%y, %z)
}"""


def test_source_ops_name_the_jax_op_behind_each_instruction():
  ops = profile_part.source_ops(TEXT)
  assert ops == {
      "fusion.5": "jit(loss)/jvp()/Block/LinearAttention/mul",
      "custom-call.2": "jit(loss)/transpose(jvp())/pallas_call",
      "x": "add"
  }
  assert profile_part.label(ops["fusion.5"]) == "jvp()/Block/LinearAttention/mul"


def test_phases_follow_the_op_name_path():
  assert profile_part.phase("jit(step)/jvp()/LinearAttention/mul") == "forward"
  assert profile_part.phase("jit(step)/transpose(jvp())/dot_general") == "backward"
  assert profile_part.phase(
      "jit(step)/transpose(jvp(jvp()))/checkpoint/rematted_computation/tanh") == "recompute"
  # deep in the model the backward marker is far from the op: the whole path is read
  assert profile_part.phase("jit(step)/transpose(jvp(scan))/body/Block/Mixer/mul") == "backward"


# a two-layer tiny model, one run of each kind: the paths, not the numbers
SMALL = [
    "--preset", "tiny", "--runs", "1", "--repeats", "1", "--model.layers=2",
    "--model.pattern=linear,sparse", "--model.dense_layers=1", "--train.seq_len=64"
]


def test_cpu_step_run_says_there_is_no_instruction_profile(capsys, monkeypatch):
  # The whole step (the parts share every line after building their program; they ran
  # on the GPU, docs/performance.md).
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() appends to it
  assert profile_part.main(["step", *SMALL]) == 0
  out = capsys.readouterr().out
  assert "step at [8, 64, 32]" in out and "NVIDIA GPUs only" in out


def test_unknown_part_is_refused(capsys):
  assert profile_part.main(["attention", "--preset", "tiny"]) == 2
  assert "part: unknown 'attention'" in capsys.readouterr().err

"""The model-FLOP count of experiments.bench_step, checked by hand on small configs."""

import dataclasses

from experiments import bench_step
from hylora.core import save_points
from hylora.core.architecture import frozen_linear
from hylora.core.config import LoRAConfig
from tests.helpers import small_config


def test_frozen_and_lora_matmul_flops():

  def step(lora):
    return sum(w.forward + w.backward for w in frozen_linear(save_points.QKV, 10, 3, 5, lora, "q"))

  assert step(None) == 4 * 10 * 3 * 5  # forward + input gradient
  assert step(LoRAConfig(rank=2, targets=("q",))) == 4 * 150 + 6 * 10 * 2 * (3 + 5)


def test_lora_targets_and_layer_counts_enter_the_count():
  cfg = small_config()
  tokens = cfg.train.batch_size * cfg.train.seq_len
  flops = bench_step.flops_per_step(cfg)
  d, v = cfg.model.d_model, cfg.model.vocab_size
  assert flops["loss (LM head)"] == 4 * tokens * d * v
  assert bench_step.layer_counts(cfg) == {"linear": 3, "sparse": 1, "moe": 3, "dense": 1}
  no_lora = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, targets=()))
  f0 = bench_step.flops_per_step(no_lora)
  r, ffn = cfg.lora.rank, cfg.model.dense_ffn
  # the dense FFN's only adapter is gate_up [d, 2 ffn]
  assert flops["dense FFN"] - f0["dense FFN"] == 6 * tokens * r * (d + 2 * ffn)

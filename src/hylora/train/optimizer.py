"""AdamW on the LoRA parameters only: warmup + cosine schedule, global-norm clipping."""

from __future__ import annotations

import optax

from hylora.core.config import TrainConfig


def learning_rate_schedule(tc: TrainConfig):
  warmup = min(tc.warmup_steps, max(tc.steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(init_value=0.0 if warmup else tc.learning_rate,
                                            peak_value=tc.learning_rate, warmup_steps=warmup,
                                            decay_steps=max(tc.steps, warmup + 1),
                                            end_value=tc.learning_rate * tc.min_lr_ratio)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(tc.clip_norm),
      optax.adamw(learning_rate_schedule(tc), b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay))

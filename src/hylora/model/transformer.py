"""The hybrid-attention MoE language model: embedding -> layer stack -> norm -> LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hylora.model.init import ParamInit, logical, weight_std

from meshes import logical_axes as ax
from hylora import ops
from hylora.core.config import LoRAConfig, ModelConfig
from hylora.core.errors import ConfigError
from hylora.model.context import ForwardContext
from hylora.model import execution
from hylora.model.execution import Execution
from hylora.model.norms import RMSNorm
from hylora.model.residual import RESIDUALS
from hylora.model.stack import LayerStack
from hylora.model.vision.tower import build_vision
from meshes.per_shard import tokens_in_device_order
from meshes.rules import constrain

IGNORE_INDEX = -100


class HybridLM(nnx.Module):

  def __init__(self, m: ModelConfig, lora: LoRAConfig | None, *, init: ParamInit):
    self.cfg = m
    emb = init.normal((m.vocab_size, m.d_model), m.init_std or 1.0, jnp.dtype(m.weight_dtype))
    self.embed = nnx.Param(emb, **logical(ax.VOCAB, ax.EMBED))
    self.stack = LayerStack(m, lora, init=init)
    output = RESIDUALS[m.residual].output  # the residual's own last read, if it has one
    self.output_residual = output(m) if output is not None else None
    self.final_norm = RMSNorm(m.d_model, ax.EMBED, eps=m.norm_eps)
    head = init.normal((m.d_model, m.vocab_size), weight_std(m.init_std, m.d_model),
                       jnp.dtype(m.weight_dtype))
    self.lm_head = nnx.Param(head, **logical(ax.EMBED, ax.VOCAB))
    self.vision = build_vision(m, lora, init)  # built last: the LM's weights do not depend on it

  def hidden(self, tokens: jax.Array, ctx: ForwardContext, images=None, image_positions=None):
    """tokens [B, T] -> (final hidden [B, T, d] bf16, aux stacked over layers).

    images [B, R, S, S, 3] uint8 tiles and image_positions [B, R, n] (-1: unused slot), when
    given, replace the embeddings at those positions with the vision tower's tokens."""
    with execution.running(ctx.execution):
      return self._hidden(tokens, ctx, images, image_positions)

  def _hidden(self, tokens, ctx, images, image_positions):
    x = jnp.take(self.embed[...], tokens, axis=0)
    if images is not None:
      if self.vision is None:
        raise ConfigError("model.vision.enabled: the batch carries images but the model has "
                          "no vision tower")
      x = self.vision(x, images, image_positions, ctx)
    x = constrain(x, (ax.BATCH, ax.SEQ, ax.EMBED))
    x, aux = self.stack(x, ctx, finish=self.output_residual)
    return self.final_norm(x), aux

  def logits(self, tokens, ctx, images=None, image_positions=None) -> jax.Array:
    """Full [B, T, vocab] fp32 logits (small inputs only: tests and inspection)."""
    h, _ = self.hidden(tokens, ctx, images, image_positions)
    return jnp.einsum("btd,dv->btv", h, self.lm_head[...], preferred_element_type=jnp.float32)

  def loss_terms(self, batch: dict, dropout_key=None, execution: Execution = Execution()):
    """(summed token loss, counted tokens, aux) for a packed batch.

    batch: tokens, labels (IGNORE_INDEX where masked), segment_ids, positions, all [B, T];
    optionally images and image_positions (see `hidden`). `execution`: kernel choices and
    the remat policy.
    """
    ctx = ForwardContext(batch["segment_ids"], batch["positions"], dropout_key, execution)
    h, aux = self.hidden(batch["tokens"], ctx, batch.get("images"), batch.get("image_positions"))
    ce = ops.resolve("cross_entropy", execution.kernels)
    # a sum over tokens: flattened in whichever order keeps each device's tokens its own
    loss_sum, count = ce(tokens_in_device_order(h), self.lm_head[...],
                         tokens_in_device_order(batch["labels"]), ignore_index=IGNORE_INDEX)
    return loss_sum, count, aux

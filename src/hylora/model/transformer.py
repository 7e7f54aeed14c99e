"""The hybrid-attention MoE language model: embedding -> layer stack -> norm -> LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hylora.model.init import ParamInit, weight_std

from hylora import axes as ax
from hylora import ops
from hylora.config import Config
from hylora.model.context import ForwardContext
from hylora.model.norms import RMSNorm
from hylora.model.stack import LayerStack
from meshes.rules import constrain

IGNORE_INDEX = -100


class HybridLM(nnx.Module):
  def __init__(self, cfg: Config, *, init: ParamInit):
    m = cfg.model
    self.cfg = cfg
    emb = init.normal((m.vocab_size, m.d_model), m.init_std or 1.0, jnp.bfloat16)
    self.embed = nnx.Param(emb, out_sharding=(ax.VOCAB, ax.EMBED))
    self.stack = LayerStack(cfg, init=init)
    self.final_norm = RMSNorm(m.d_model, ax.EMBED, eps=m.norm_eps)
    head = init.normal((m.d_model, m.vocab_size), weight_std(m.init_std, m.d_model), jnp.bfloat16)
    self.lm_head = nnx.Param(head, out_sharding=(ax.EMBED, ax.VOCAB))

  def hidden(self, tokens: jax.Array, ctx: ForwardContext):
    """tokens [B, T] -> (final hidden [B, T, d] bf16, aux stacked over layers)."""
    x = jnp.take(self.embed[...], tokens, axis=0)
    x = constrain(x, (ax.BATCH, ax.SEQ, ax.EMBED))
    x, aux = self.stack(x, ctx)
    return self.final_norm(x), aux

  def logits(self, tokens, ctx) -> jax.Array:
    """Full [B, T, vocab] fp32 logits (small inputs only: tests and inspection)."""
    h, _ = self.hidden(tokens, ctx)
    return jnp.einsum("btd,dv->btv", h, self.lm_head[...], preferred_element_type=jnp.float32)

  def loss_terms(self, batch: dict, dropout_key=None):
    """(summed token loss, counted tokens, aux) for a packed batch.

    batch: tokens, labels (IGNORE_INDEX where masked), segment_ids, positions, all [B, T].
    """
    ctx = ForwardContext(batch["segment_ids"], batch["positions"], dropout_key)
    h, aux = self.hidden(batch["tokens"], ctx)
    b, t, d = h.shape
    ce = ops.resolve("cross_entropy", self.cfg.kernels)
    loss_sum, count = ce(h.reshape(b * t, d), self.lm_head[...], batch["labels"].reshape(-1),
                         ignore_index=IGNORE_INDEX)
    return loss_sum, count, aux

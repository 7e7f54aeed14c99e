"""The layer stack: runs of identical layer periods, each stacked and scanned.

The layer kinds (e.g. the first two dense, then `L L L S` repeating) are cut into
periods of `len(pattern)` layers; consecutive identical periods form one segment whose
parameters carry a leading `layers` axis and run under one `lax.scan`. Compile time
depends on the number of distinct periods, not on depth. Under the "block_attention"
residual a segment also ends at every block boundary (`plan_segments`), so a segment's
completed blocks are fixed inputs of its scan (`hylora.model.residual`).

The memory policy (`hylora.model.remat_policy`) wraps each layer, not the period: the backward
recomputes one layer at a time, so its working set is one layer's activations (a
period of four MoE layers would hold four layers' all-to-all buffers at once).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hylora.model.init import ParamInit

from meshes import logical_axes as ax
from hylora.model import remat_policy
from hylora.core.architecture import model_segments
from hylora.core.config import LoRAConfig, ModelConfig
from hylora.model.layer import DecoderLayer
from hylora.model.residual import RESIDUALS


class Period(nnx.Module):

  def __init__(self, m: ModelConfig, lora: LoRAConfig | None, kinds, *, init: ParamInit):
    self.layers = nnx.List([DecoderLayer(m, lora, mixer, ffn, init=init) for mixer, ffn in kinds])

  def __call__(self, x, ctx, first_layer):
    auxes = []
    for i, layer in enumerate(self.layers):
      layer_ctx = ctx.for_layer(first_layer + i)
      x, aux = remat_policy.wrap(lambda x, layer=layer, c=layer_ctx: layer(x, c),
                                 ctx.execution.memory)(x)
      auxes.append(aux)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *auxes)


class Segment(nnx.Module):

  def __init__(self, m: ModelConfig, lora: LoRAConfig | None, kinds, repeats: int, *,
               init: ParamInit):
    self.period_len = len(kinds)
    self.repeats = repeats
    self.residual = RESIDUALS[m.residual]

    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: ax.LAYERS})
    def make(seed):
      return Period(m, lora, kinds, init=ParamInit(seed))

    self.periods = make(init.fork(repeats))

  def __call__(self, stream, ctx, first_layer: int):
    graphdef, state = nnx.split(self.periods)
    # The stream's fixed part is an input of every step, not carry: the backward keeps a
    # scan's carry once per step.
    carried, fixed = self.residual.split(stream)

    def body(carried, xs):
      period_state, index = xs
      period = nnx.merge(graphdef, period_state)
      stream, aux = period(self.residual.merge(carried, fixed), ctx,
                           first_layer + index * self.period_len)
      return self.residual.split(stream)[0], aux

    carried, aux = jax.lax.scan(body, carried, (state, jnp.arange(self.repeats)))
    # aux leaves: [repeats, period_len, ...] -> [repeats * period_len, ...] in layer order
    return self.residual.merge(carried, fixed), jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]),
                                                             aux)


class LayerStack(nnx.Module):

  def __init__(self, m: ModelConfig, lora: LoRAConfig | None, *, init: ParamInit):
    self.plan = model_segments(m)
    self.residual = RESIDUALS[m.residual]  # the stream the layers carry
    self.cfg = m
    self.segments = nnx.List(
        [Segment(m, lora, chunk, repeats, init=init) for chunk, repeats in self.plan])

  def __call__(self, x, ctx, finish=None):
    """x [B, T, d] embeddings -> (final hidden, aux stacked over layers). `finish`: the
    module that ends a stream whose scheme has an `output` (hylora.model.residual)."""
    first, auxes = 0, []
    stream = self.residual.start(self.cfg, x)
    for segment in self.segments:
      stream = self.residual.enter(self.cfg, stream, first)
      stream, aux = segment(stream, ctx, first)
      first += segment.period_len * segment.repeats
      auxes.append(aux)
    hidden = finish(stream) if self.residual.output is not None else self.residual.finish(stream)
    return hidden, jax.tree.map(lambda *a: jnp.concatenate(a), *auxes)

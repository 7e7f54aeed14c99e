"""How a decoder layer reads and writes the residual stream, chosen by `model.residual`.

The stream is whatever the layer stack carries from layer to layer (through `lax.scan`):
  "add"        the hidden state x; a layer computes x + mixer(..) + ffn(..) from it.
  "depth_mix"  (x, history): history holds the outputs of the `residual_window` layers
               before the current one, newest first (zeros before the first layer). The
               attention block reads the registered op "residual_mix" of x and history
               with learned weights instead of x: a deep residual connection.
  "block_attention"  (partial, blocks, layer): Kimi K3's attention residuals. The layers
               form blocks of `residual_block`; `blocks` holds the embedding and the
               summed outputs of each finished block, `partial` the sum of the current
               block's outputs so far. The mixer and the FFN each read a softmax-weighted
               mix of the blocks and the partial sum, weighted by a learned pseudo-query.
               Only (partial, layer) rides in the scan's carry (see split / merge).

A scheme is a class here with the methods of `Residual`; the layer calls them as
  x = block_input(stream)                 the mixer's input (before its norm)
  carry, y = ffn_input(stream, x, h)      h = the mixer's output; y: the FFN's input,
                                          carry: the sum the FFN's output adds to
  stream = update(stream, carry + ffn(y))
and the stack wraps the layers in start(m, embeddings) ... finish(stream). A scheme whose
`output` is a module class ends with that module (built by the model) instead of finish.
Each scanned segment receives enter(m, stream, first layer) and scans split(stream)'s
carried part, the fixed part an input of every step (merge puts them back together).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshes import logical_axes as ax
from hylora import ops
from hylora.core.config import ModelConfig
from hylora.model.init import ParamInit, logical
from hylora.model.lora import LoRAParam
from meshes.rules import constrain

_X = (ax.BATCH, ax.SEQ, ax.EMBED)


class Residual(nnx.Module):
  """The contract; the default FFN input is the plain residual sum x + mixer output."""

  output = None  # a module class that finishes the stream with parameters, or None

  @staticmethod
  def start(m: ModelConfig, x: jax.Array):
    raise NotImplementedError

  @staticmethod
  def finish(stream) -> jax.Array:
    raise NotImplementedError

  @staticmethod
  def enter(m: ModelConfig, stream, first_layer: int):
    """The stream as the scanned segment starting at layer `first_layer` receives it."""
    del m, first_layer
    return stream

  @staticmethod
  def split(stream):
    """(what the layer scan carries, what stays fixed over a segment)."""
    return stream, ()

  @staticmethod
  def merge(carried, fixed):
    """The stream from split's two parts."""
    del fixed
    return carried

  def block_input(self, stream, ctx) -> jax.Array:
    raise NotImplementedError

  def ffn_input(self, stream, x: jax.Array, h: jax.Array, ctx):
    """(the sum the FFN's output is added to, the FFN's input) after the mixer read x and
    returned h."""
    carry = x + h
    return carry, carry

  def update(self, stream, out: jax.Array):
    raise NotImplementedError


class AddResidual(Residual):
  """The usual pre-norm residual: the stream is x itself."""

  def __init__(self, m: ModelConfig, *, init: ParamInit):
    del m, init

  @staticmethod
  def start(m: ModelConfig, x: jax.Array):
    return x

  @staticmethod
  def finish(stream) -> jax.Array:
    return stream

  def block_input(self, stream, ctx) -> jax.Array:
    return stream

  def update(self, stream, out: jax.Array):
    return out


class DepthMixResidual(Residual):
  """The block input is w0 * x + sum_j w_j * (output of the j-th earlier layer).

  The W + 1 weights start at (1, 0, ..., 0), so the model starts out identical to the
  "add" residual; they are tiny and train with the LoRA adapters.
  """

  def __init__(self, m: ModelConfig, *, init: ParamInit):
    del init
    self.weights = LoRAParam(
        jnp.zeros((m.residual_window + 1,), jnp.float32).at[0].set(1.0), **logical(None))

  @staticmethod
  def start(m: ModelConfig, x: jax.Array):
    return x, jnp.zeros((m.residual_window, *x.shape), x.dtype)

  @staticmethod
  def finish(stream) -> jax.Array:
    return stream[0]

  def block_input(self, stream, ctx) -> jax.Array:
    x, history = stream
    mix = ops.resolve("residual_mix", ctx.execution.kernels)
    return constrain(mix(x, history, self.weights[...]), _X)

  def update(self, stream, out: jax.Array):
    x, history = stream
    # This layer's input is the previous layer's output: it joins the history.
    history = jnp.concatenate([x[None], history[:-1]], axis=0)
    return out, constrain(history, (None, *_X))


def attention_residual(partial: jax.Array, blocks: tuple[jax.Array, ...], partial_valid,
                       norm: jax.Array, query: jax.Array, eps: float) -> jax.Array:
  """softmax_n(q . RMSNorm(v_n)) weighted sum of the values v = (*blocks, partial), in
  fp32, partial's dtype out; the partial sum leaves the softmax where `partial_valid` is
  false. blocks: [B, T, d] fp32 arrays, read one by one (never stacked: a stack would be
  a copy of every block per layer); partial [B, T, d]; norm and query [d] (RMSNorm's
  weight and the pseudo-query)."""
  w = norm.astype(jnp.float32) * query.astype(jnp.float32)

  def score(v):
    return jnp.sum(v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps) * w, axis=-1)

  values = (*blocks, partial.astype(jnp.float32))
  scores = [score(v) for v in values]
  scores[-1] = jnp.where(partial_valid, scores[-1], -jnp.inf)
  probs = jax.nn.softmax(jnp.stack(scores), axis=0)
  out = sum(probs[n][..., None] * v for n, v in enumerate(values))
  return out.astype(partial.dtype)


def _query_pair(d: int) -> tuple[nnx.Param, nnx.Param]:
  """(RMSNorm weight, pseudo-query), frozen base weights. A zero query weighs every value
  equally; checkpoints carry the trained ones."""
  norm = nnx.Param(jnp.ones((d,), jnp.float32), **logical(None))
  return norm, nnx.Param(jnp.zeros((d,), jnp.float32), **logical(None))


class BlockAttentionOutput(nnx.Module):
  """The model's last read of the block attention residual stream (before the final
  norm): AR over every block and the last partial sum."""

  def __init__(self, m: ModelConfig):
    self.eps = m.norm_eps
    self.norm, self.query = _query_pair(m.d_model)

  def __call__(self, stream) -> jax.Array:
    partial, blocks, _ = stream
    return attention_residual(partial, blocks, True, self.norm[...], self.query[...], self.eps)


class BlockAttentionResidual(Residual):
  """Kimi K3's block attention residuals (KimiK3DecoderLayer), S = `residual_block`:

    the mixer reads AR_mixer(partial | blocks); at a block's first layer (index % S == 0)
    the partial sum joins the blocks and restarts from the mixer's output, else the
    mixer's output adds to it; the FFN reads AR_ffn(partial | blocks) and its output adds
    to the partial sum.

  The stream is (partial, blocks, layer): blocks a tuple of [B, T, d] fp32 arrays, layer
  the index of the next layer. The scanned segments break at block starts
  (hylora.core.architecture.plan_segments), so the blocks only grow between scans: there
  (`enter`) the partial sum joins them and restarts from zeros, which the block's first
  mixer leaves out of its read. Inside a scan the blocks are fixed inputs, not carry, and
  the backward keeps them once rather than once per layer.
  """

  output = BlockAttentionOutput

  def __init__(self, m: ModelConfig, *, init: ParamInit):
    del init
    self.block = m.residual_block
    self.eps = m.norm_eps
    self.mixer_norm, self.mixer_query = _query_pair(m.d_model)
    self.ffn_norm, self.ffn_query = _query_pair(m.d_model)

  @staticmethod
  def start(m: ModelConfig, x: jax.Array):
    return x, (), jnp.zeros((), jnp.int32)

  @staticmethod
  def enter(m: ModelConfig, stream, first_layer: int):
    partial, blocks, layer = stream
    if first_layer % m.residual_block:
      return stream
    block = constrain(partial.astype(jnp.float32), _X)
    return jnp.zeros_like(partial), (*blocks, block), layer

  @staticmethod
  def split(stream):
    partial, blocks, layer = stream
    return (partial, layer), blocks

  @staticmethod
  def merge(carried, fixed):
    partial, layer = carried
    return partial, fixed, layer

  def block_input(self, stream, ctx) -> jax.Array:
    partial, blocks, layer = stream
    # At a block's first layer the partial sum is the zeros `enter` left: not a value.
    return attention_residual(partial, blocks, layer % self.block != 0, self.mixer_norm[...],
                              self.mixer_query[...], self.eps)

  def ffn_input(self, stream, x: jax.Array, h: jax.Array, ctx):
    partial, blocks, _ = stream
    carry = partial + h
    return carry, attention_residual(carry, blocks, True, self.ffn_norm[...], self.ffn_query[...],
                                     self.eps)

  def update(self, stream, out: jax.Array):
    _, blocks, layer = stream
    return out, blocks, layer + 1


RESIDUALS = {
    "add": AddResidual,
    "depth_mix": DepthMixResidual,
    "block_attention": BlockAttentionResidual
}

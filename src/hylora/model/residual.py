"""How a decoder layer reads and writes the residual stream, chosen by `model.residual`.

The stream is whatever the layer stack carries from layer to layer (through `lax.scan`):
  "add"        the hidden state x; a layer computes x + mixer(..) + ffn(..) from it.
  "depth_mix"  (x, history): history holds the outputs of the `residual_window` layers
               before the current one, newest first (zeros before the first layer). The
               attention block reads the registered op "residual_mix" of x and history
               with learned weights instead of x: a deep residual connection.

A new residual scheme is a new class here with the same four methods.
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


class AddResidual(nnx.Module):
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


class DepthMixResidual(nnx.Module):
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


RESIDUALS = {"add": AddResidual, "depth_mix": DepthMixResidual}

"""A layer part's backward memory as the compiler sees it: the planner's working-set term.

The planner's analytic working set (the save points of the largest layer plus the stream's
cotangents) misses what a part's backward holds beyond its save points: transients of
the attention kernels, the MoE's permuted copies and their cotangents, several times its
save points (docs/memory.md). So the working set is measured instead: every distinct mixer
and FFN of the config is compiled, from abstract shapes (nothing is allocated), as
forward + input and LoRA gradients of one device's tokens, without remat, on the
current backend; its temporaries are what recomputing and differentiating that part
needs at once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hylora.core.config import Config
from hylora.model import LoRAParam
from hylora.model.context import ForwardContext
from hylora.model.execution import Execution
from hylora.model.ffn import FFNS
from hylora.model.init import ParamInit
from hylora.model.mixers import MIXERS


def part_gradients(graphdef):
  """jit of one mixer / FFN's forward + gradients (LoRA and input): f(lora, x, rest, ctx).
  Frozen weights are arguments: closed over, jit would embed them as constants."""

  def loss(lora, x, rest, ctx):
    y, _ = nnx.merge(graphdef, lora, rest)(x, ctx)
    return jnp.sum(y.astype(jnp.float32))

  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def compiled_part(cfg: Config, part: str, batch: int, seq: int):
  """The compiled forward + gradients of one part ("linear", "sparse", "moe", "dense")
  on [batch, seq, d_model] bf16 activations."""
  table = MIXERS if part in MIXERS else FFNS
  if part not in table:
    raise ValueError(f"part: unknown {part!r}; choose from {sorted(MIXERS) + sorted(FFNS)}")
  module = nnx.eval_shape(lambda: table[part](cfg.model, cfg.lora, init=ParamInit(0)))
  graphdef, lora, rest = nnx.split(module, LoRAParam, ...)
  x = jax.ShapeDtypeStruct((batch, seq, cfg.model.d_model), jnp.bfloat16)
  rows = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  ctx = ForwardContext(rows, rows, execution=Execution(cfg.kernels, cfg.memory))
  return part_gradients(graphdef).lower(lora, x, rest, ctx).compile()


def part_temp_bytes(cfg: Config, part: str, tokens: int) -> int:
  """XLA's temporary bytes for one part's forward + backward over `tokens` tokens (whole
  sequences of train.seq_len where they fit, else one shorter row)."""
  seq = min(cfg.train.seq_len, tokens)
  compiled = compiled_part(cfg, part, max(1, tokens // seq), seq)
  return int(compiled.memory_analysis().temp_size_in_bytes)


def measured_working_bytes(cfg: Config, tokens: int) -> int:
  """The largest layer's backward working set: over the config's layer kinds, the mixer's
  plus the FFN's compiled temporaries (an upper bound: the FFN's backward runs first and
  frees most of its own before the mixer's starts)."""
  temp = {}
  for mixer, ffn in set(cfg.model.layer_kinds()):
    for part in (mixer, ffn):
      if part not in temp:
        temp[part] = part_temp_bytes(cfg, part, tokens)
  return max(temp[mixer] + temp[ffn] for mixer, ffn in set(cfg.model.layer_kinds()))

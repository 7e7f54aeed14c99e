"""The MoE FFN: router -> dispatcher (routed experts) -> + shared experts."""

from __future__ import annotations

import jax
from flax import nnx

from hylora.model.init import ParamInit, logical

from hylora.core.config import LoRAConfig, ModelConfig
from hylora.model.ffn.activations import Activation
from hylora.model.ffn.dispatchers import get_dispatcher
from hylora.model.ffn.experts import RoutedExperts
from hylora.model.ffn.mlp import SwiGLU
from hylora.model.ffn.placement import ExpertPlacement, initial_placement, route_to_slots
from hylora.model.ffn.router import Router


class MoE(nnx.Module):

  def __init__(self, m: ModelConfig, lora: LoRAConfig | None, *, init: ParamInit,
               expert_width: int | None = None):
    """`expert_width`: the width of the rows the routed experts see (default d_model)."""
    moe = m.moe
    self.cfg = moe
    self.router = Router(m.d_model, moe, init_std=m.init_std, init=init, dtype=m.weight_dtype)
    self.experts = RoutedExperts(m, lora, init=init, width=expert_width)
    # Which expert each stored slot holds (hylora.train.balancer re-places hot experts).
    self.placement = ExpertPlacement(initial_placement(moe.experts, moe.slots), **logical(None))
    self.shared = (SwiGLU(m.d_model, moe.expert_ffn *
                          moe.shared_experts, lora=lora, init_std=m.init_std, init=init,
                          activation=Activation.of(m), dtype=m.weight_dtype, name="shared_gate_up")
                   if moe.shared_experts > 0 else None)
    self.dispatch = get_dispatcher(moe.dispatch)

  def routed(self, x: jax.Array, rows: jax.Array, seq_len: int, ctx):
    """x [B, T, d] chooses the experts; rows [B, T, w] (x itself, or a projection of it)
    pass through them -> (weighted expert outputs [B, T, w], aux). The tokens are never
    flattened outside the per-device dispatch: [B, T] sharded over both the batch and
    the sequence (context parallelism) has no contiguous flat layout."""
    weights, experts, aux = self.router(x, seq_len=seq_len)
    table = self.placement[...]
    slots = route_to_slots(experts, table, self.cfg.experts)
    y, stats = self.dispatch(rows, weights, slots, self.experts.weights(),
                             self.experts.options(ctx.execution.kernels),
                             num_experts=table.shape[0], dropout_key=ctx.dropout_key, moe=self.cfg)
    return y, {**aux, **stats}

  def with_shared(self, y: jax.Array, x: jax.Array, ctx) -> jax.Array:
    """The routed output y [B, T, d] plus the shared experts of x."""
    if self.shared is None:
      return y
    return y + self.shared(x, ctx.dropout_key)

  def __call__(self, x: jax.Array, ctx):
    y, aux = self.routed(x, x, x.shape[1], ctx)
    return self.with_shared(y, x, ctx), aux

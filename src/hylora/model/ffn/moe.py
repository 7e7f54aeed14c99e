"""The MoE FFN: router -> dispatcher (routed experts) -> + shared experts."""

from __future__ import annotations

import jax
from flax import nnx

from hylora.model.init import ParamInit, logical

from hylora.core.config import LoRAConfig, ModelConfig
from hylora.model.ffn.dispatchers import get_dispatcher
from hylora.model.ffn.experts import RoutedExperts
from hylora.model.ffn.mlp import SwiGLU
from hylora.model.ffn.placement import ExpertPlacement, initial_placement, route_to_slots
from hylora.model.ffn.router import Router


class MoE(nnx.Module):

  def __init__(self, m: ModelConfig, lora: LoRAConfig | None, *, init: ParamInit):
    moe = m.moe
    self.cfg = moe
    self.router = Router(m.d_model, moe, init_std=m.init_std, init=init, dtype=m.weight_dtype)
    self.experts = RoutedExperts(m, lora, init=init)
    # Which expert each stored slot holds (hylora.train.balancer re-places hot experts).
    self.placement = ExpertPlacement(initial_placement(moe.experts, moe.slots), **logical(None))
    self.shared = (SwiGLU(m.d_model, moe.expert_ffn *
                          moe.shared_experts, lora=lora, init_std=m.init_std, init=init,
                          dtype=m.weight_dtype) if moe.shared_experts > 0 else None)
    self.dispatch = get_dispatcher(moe.dispatch)

  def __call__(self, x: jax.Array, ctx):
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    weights, experts, aux = self.router(flat, seq_len=t)
    table = self.placement[...]
    slots = route_to_slots(experts, table, self.cfg.experts)
    y, stats = self.dispatch(flat, weights, slots, self.experts.weights(),
                             self.experts.options(ctx.execution.kernels),
                             num_experts=table.shape[0], dropout_key=ctx.dropout_key, moe=self.cfg)
    y = y.reshape(b, t, d)
    if self.shared is not None:
      y = y + self.shared(x, ctx.dropout_key)
    return y, {**aux, **stats}

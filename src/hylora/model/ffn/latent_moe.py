"""The latent MoE FFN (Kimi K3): the router reads the token, the routed experts run on a
narrower latent projection of it.

  y = up(norm(sum_k w_k expert_k(down(x)))) + shared(x)

down [d, latent] and up [latent, d] are frozen projections, norm an RMSNorm over the
latent; router, placement, dispatch and shared experts are the MoE's own (moe.py).
"""

from __future__ import annotations

import jax

from hylora.model.init import ParamInit

from meshes import logical_axes as ax
from hylora.core.config import LoRAConfig, ModelConfig
from hylora.core.errors import ConfigError
from hylora.model.ffn.moe import MoE
from hylora.model.lora import Linear
from hylora.model.norms import RMSNorm


class LatentMoE(MoE):

  def __init__(self, m: ModelConfig, lora: LoRAConfig | None, *, init: ParamInit):
    latent = m.moe.latent_dim
    if latent <= 0:
      raise ConfigError(f"model.moe.latent_dim: the latent MoE needs a width > 0, got {latent}")
    super().__init__(m, lora, init=init, expert_width=latent)
    d = m.d_model
    self.routed_expert_down_proj = Linear((d,), (latent,), (ax.EMBED,), (ax.LOW_RANK,),
                                          name="routed_expert_down_proj", lora=None, init=init,
                                          init_std=m.init_std, dtype=m.weight_dtype)
    self.routed_expert_norm = RMSNorm(latent, ax.LOW_RANK, eps=m.norm_eps)
    self.routed_expert_up_proj = Linear((latent,), (d,), (ax.LOW_RANK,), (ax.EMBED,),
                                        name="routed_expert_up_proj", lora=None, init=init,
                                        init_std=m.init_std, dtype=m.weight_dtype)

  def __call__(self, x: jax.Array, ctx):
    h, aux = self.routed(x, self.routed_expert_down_proj(x), x.shape[1], ctx)
    y = self.routed_expert_up_proj(self.routed_expert_norm(h))
    return self.with_shared(y, x, ctx), aux

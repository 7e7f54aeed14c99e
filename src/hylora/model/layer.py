"""A pre-norm decoder layer: x + mixer(norm(x)), then + ffn(norm(.)).

The mixer's and the FFN's inputs are read from the residual stream by the scheme
`model.residual` chooses (hylora.model.residual); the layer's output is written back to
the stream.
"""

from __future__ import annotations

from flax import nnx

from hylora.model.init import ParamInit

from meshes import logical_axes as ax
from hylora.core import save_points
from hylora.core.config import LoRAConfig, ModelConfig
from hylora.model.aux import merge_aux
from hylora.model.ffn import FFNS
from hylora.model.mixers import MIXERS
from hylora.model.norms import RMSNorm
from hylora.model.residual import RESIDUALS
from meshes.rules import constrain


class DecoderLayer(nnx.Module):

  def __init__(self, m: ModelConfig, lora: LoRAConfig | None, mixer: str, ffn: str, *,
               init: ParamInit):
    d, eps = m.d_model, m.norm_eps
    self.model_cfg = m
    self.residual = RESIDUALS[m.residual](m, init=init)
    self.mixer_norm = RMSNorm(d, ax.EMBED, eps=eps)
    self.mixer = MIXERS[mixer](m, lora, init=init)
    self.ffn_norm = RMSNorm(d, ax.EMBED, eps=eps)
    self.ffn = FFNS[ffn](m, lora, init=init)

  def __call__(self, stream, ctx):
    names = (ax.BATCH, ax.SEQ, ax.EMBED)
    x = save_points.tag(constrain(self.residual.block_input(stream, ctx), names),
                        save_points.LAYER_INPUT)
    h, mixer_aux = self.mixer(save_points.tag(self.mixer_norm(x), save_points.MIXER_NORM), ctx)
    x, y = self.residual.ffn_input(stream, x, h, ctx)
    x, y = constrain(x, names), constrain(y, names)
    h, ffn_aux = self.ffn(save_points.tag(self.ffn_norm(y), save_points.FFN_NORM), ctx)
    out = constrain(x + h, names)
    return self.residual.update(stream, out), merge_aux(self.model_cfg, mixer_aux, ffn_aux)

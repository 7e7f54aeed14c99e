"""One pre-norm ViT block: bidirectional attention over a tile's patches, then a GELU MLP.

Its linears are named `vision.<name>` so that LoRA reaches them only when a target
pattern asks for it (e.g. `--lora.targets=q,k,v,o,gate_up,vision.*`); the LM's default
targets ("q", "k", ...) never match these names.
"""

from __future__ import annotations

import jax
from flax import nnx

from meshes import logical_axes as ax
from hylora.core.config import LoRAConfig, ModelConfig
from hylora.model.init import ParamInit
from hylora.model.lora import Linear
from hylora.model.vision.layer_norm import LayerNorm
from meshes.rules import constrain

# The encoder's width and heads reuse the LM's logical names: they shard the same way
# (FSDP over every device) and need no rules of their own.
_WIDTH, _HEADS, _HEAD_DIM, _MLP = ax.EMBED, ax.HEADS, ax.HEAD_DIM, ax.MLP


def vision_linear(m: ModelConfig, lora: LoRAConfig | None, name: str, in_shape, out_shape, in_axes,
                  out_axes, *, init: ParamInit) -> Linear:
  return Linear(in_shape, out_shape, in_axes, out_axes, name=f"vision.{name}", lora=lora, init=init,
                init_std=m.init_std)


class EncoderBlock(nnx.Module):

  def __init__(self, m: ModelConfig, lora: LoRAConfig | None, *, init: ParamInit):
    v = m.vision
    w, h, hd = v.width, v.heads, v.width // v.heads

    def lin(name, i, o, ia, oa):
      return vision_linear(m, lora, name, i, o, ia, oa, init=init)

    self.attn_norm = LayerNorm(w)
    self.q = lin("q", (w,), (h, hd), (_WIDTH,), (_HEADS, _HEAD_DIM))
    self.k = lin("k", (w,), (h, hd), (_WIDTH,), (_HEADS, _HEAD_DIM))
    self.v = lin("v", (w,), (h, hd), (_WIDTH,), (_HEADS, _HEAD_DIM))
    self.o = lin("o", (h, hd), (w,), (_HEADS, _HEAD_DIM), (_WIDTH,))
    self.mlp_norm = LayerNorm(w)
    self.fc1 = lin("fc1", (w,), (v.mlp,), (_WIDTH,), (_MLP,))
    self.fc2 = lin("fc2", (v.mlp,), (w,), (_MLP,), (_WIDTH,))

  def __call__(self, x: jax.Array, dropout_key=None) -> jax.Array:
    """x [tiles, patches, width] -> same shape."""
    names = (ax.BATCH, ax.SEQ, _WIDTH)
    h = self.attn_norm(x)
    q, k, v = (proj(h, dropout_key) for proj in (self.q, self.k, self.v))
    # Every patch sees every patch of its own tile; tiles never see each other.
    o = jax.nn.dot_product_attention(q, k, v)
    x = constrain(x + self.o(o, dropout_key), names)
    h = jax.nn.gelu(self.fc1(self.mlp_norm(x), dropout_key))
    return constrain(x + self.fc2(h, dropout_key), names)

"""Sequence mixers, chosen per layer by `ModelConfig.pattern`.

A new attention structure is a new module registered here, never a branch inside an
existing one.
"""

from hylora.model.mixers.kda import KimiDeltaAttention
from hylora.model.mixers.linear_attention import LinearAttention
from hylora.model.mixers.mla import LatentAttention
from hylora.model.mixers.sparse_attention import SparseAttention

MIXERS = {
    "linear": LinearAttention,
    "sparse": SparseAttention,
    "kda": KimiDeltaAttention,
    "mla": LatentAttention
}

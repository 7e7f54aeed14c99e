"""Feed-forward blocks, chosen per layer: the first `dense_layers` are dense, the rest MoE."""

from hylora.model.ffn.mlp import DenseFFN
from hylora.model.ffn.moe import MoE

FFNS = {"dense": DenseFFN, "moe": MoE}

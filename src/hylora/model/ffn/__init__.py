"""Feed-forward blocks, chosen per layer: the first `dense_layers` are dense, the rest
`model.ffn` (MoE or latent MoE)."""

from hylora.model.ffn.latent_moe import LatentMoE
from hylora.model.ffn.mlp import DenseFFN
from hylora.model.ffn.moe import MoE

FFNS = {"dense": DenseFFN, "moe": MoE, "latent_moe": LatentMoE}

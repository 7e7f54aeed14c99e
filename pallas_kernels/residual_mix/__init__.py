"""Residual mix: a block's input as a learned weighted sum of the residual stream and the
outputs of earlier layers (a "deep residual" structure).

    residual_mix(x [B, T, d], history [W, B, T, d], weights [W + 1]) -> [B, T, d]
        = weights[0] * x + sum_j weights[j + 1] * history[j]   (fp32 math, x's dtype out)

`residual_mix_reference` is the plain-JAX ground truth; `residual_mix` a fused Pallas
forward (interpreted on CPU) with an XLA backward.
"""

from pallas_kernels.residual_mix.kernel import residual_mix
from pallas_kernels.residual_mix.reference import residual_mix_reference

__all__ = ["residual_mix", "residual_mix_reference"]

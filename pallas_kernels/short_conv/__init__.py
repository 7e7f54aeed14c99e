"""The delta rule's prologue: a short causal depthwise convolution over time, SiLU and,
for q and k, the per-head L2 norm.

    short_conv_silu(x [B, T, H, D], weight [H, D, K], segment_ids [B, T] | None,
                    normalize=False) -> [B, T, H, D] in x's dtype

`short_conv_silu_reference` is the plain-JAX ground truth (`causal_depthwise_conv`, SiLU,
`l2_normalize`); `short_conv_silu` one fused Pallas pass each way (interpreted on CPU):
each head's rows streamed (rows.py, form="rows", the default) or token blocks shifted by
products (kernel.py, form="blocks").
"""

from pallas_kernels.short_conv.kernel import short_conv_silu
from pallas_kernels.short_conv.reference import causal_depthwise_conv, short_conv_silu_reference

__all__ = ["causal_depthwise_conv", "short_conv_silu", "short_conv_silu_reference"]

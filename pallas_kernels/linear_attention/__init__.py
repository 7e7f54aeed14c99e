"""Chunked gated linear attention: plain-JAX references and Pallas kernels."""
from pallas_kernels.linear_attention.gla import chunked_gla
from pallas_kernels.linear_attention.kda import chunked_kda
from pallas_kernels.linear_attention.reference import (gla_chunked, gla_recurrent, kda_chunked,
                                                       kda_recurrent)

__all__ = [
    "chunked_gla", "chunked_kda", "gla_chunked", "gla_recurrent", "kda_chunked", "kda_recurrent"
]

"""Top-K sparse attention (DeepSeek-V3.2 style): indexer top-K selection and GQA
attention over the selected keys. See reference.py for the exact definitions."""

from pallas_kernels.sparse_attention.indexer_topk import topk_indices
from pallas_kernels.sparse_attention.reference import (
    indexer_kl_loss,
    sparse_attention_reference,
    topk_indices_reference,
)
from pallas_kernels.sparse_attention.sparse_attention_vjp import sparse_attention

__all__ = [
    "sparse_attention",
    "topk_indices",
    "indexer_kl_loss",
    "sparse_attention_reference",
    "topk_indices_reference",
]

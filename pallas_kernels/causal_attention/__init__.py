"""Causal softmax attention over packed documents, one key head per query head, value
head dim free. See reference.py for the exact definition; cudnn.py is the GPU path."""

from pallas_kernels.causal_attention.cudnn import cudnn_causal_attention
from pallas_kernels.causal_attention.reference import causal_attention_reference

__all__ = ["causal_attention_reference", "cudnn_causal_attention"]

"""Matmuls against packed frozen weights (FP8 block-scaled, MXFP4, INT4), dequantized
tile by tile inside the kernels: formats.py (the formats), reference.py."""

from .formats import FORMATS, Format, dequantize, quantize
from .reference import quantized_grouped_matmul_reference, quantized_matmul_reference

__all__ = [
    "FORMATS",
    "Format",
    "dequantize",
    "quantize",
    "quantized_grouped_matmul_reference",
    "quantized_matmul_reference",
]

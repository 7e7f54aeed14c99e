"""Matmuls against packed frozen weights (FP8 block-scaled, MXFP4, INT4), dequantized
tile by tile inside the kernels: formats.py (the formats), reference.py (dequantize, then
a bf16 product), kernel.py (the Pallas Triton kernels), quantized_matmul.py (the
differentiable ops: input gradient only, the weights are frozen), loop_over_groups.py
(the memory-faithful stand-in for XLA:CPU).

    quantized_grouped_matmul(lhs [M, K], codes [G, N, ...], scales, group_sizes, *, fmt)
      -> [M, N]
    quantized_matmul(x [..., K], codes [N, ...], scales, *, fmt) -> [..., N]

On GPU they run the kernels; elsewhere the loop over groups (chosen when traced, so a CPU
program never runs an interpreted kernel).
"""

import jax

from .formats import FORMATS, Format, dequantize, quantize
from .kernel import quantized_grouped_matmul_kernel
from .loop_over_groups import loop_product, loop_quantized_grouped_matmul, loop_quantized_matmul
from .quantized_matmul import make_quantized_grouped_matmul, make_quantized_matmul
from .reference import quantized_grouped_matmul_reference, quantized_matmul_reference


def _kernel(x, codes, scales, group_sizes, *, fmt, transpose):
  if jax.default_backend() == "gpu":
    return quantized_grouped_matmul_kernel(x, codes, scales, group_sizes, fmt=fmt,
                                           transpose=transpose)
  return loop_product(x, codes, scales, group_sizes, fmt=fmt, transpose=transpose)


quantized_grouped_matmul = make_quantized_grouped_matmul(_kernel)
quantized_matmul = make_quantized_matmul(quantized_grouped_matmul)

__all__ = [
    "FORMATS",
    "Format",
    "dequantize",
    "quantize",
    "quantized_grouped_matmul",
    "quantized_matmul",
    "loop_quantized_grouped_matmul",
    "loop_quantized_matmul",
    "make_quantized_grouped_matmul",
    "make_quantized_matmul",
    "quantized_grouped_matmul_reference",
    "quantized_matmul_reference",
]

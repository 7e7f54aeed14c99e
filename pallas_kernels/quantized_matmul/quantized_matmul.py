"""Differentiable matmuls against packed frozen weights, on a pluggable kernel.

`make_quantized_grouped_matmul(kernel)` wraps a kernel with the contract
    kernel(x, codes [G, N, ...], scales [G, ...], group_sizes, *, fmt, transpose)
      transpose=False: x [M, K] -> [M, N], row i = x[i] @ W[g(i)]^T
      transpose=True:  x [M, N] -> [M, K], row i = x[i] @ W[g(i)]
      rows at or past sum(group_sizes): 0
(W the dequantized weight, formats.dequantize) in a `jax.custom_vjp`. The weights are
frozen: the backward computes only d lhs = dout @ W[g] per group (the same kernel, the
other orientation of the same packed tiles) and returns no gradient for codes, scales or
group_sizes. With symbolic zeros, d lhs is computed only when lhs is perturbed, and the
residuals are the packed weights and group sizes: no activation is kept.
Tests swap the kernel for a plain-JAX one to check this logic on CPU.
"""

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from . import formats
from .input_checks import check_quantized_grouped_matmul_inputs, check_quantized_matmul_inputs


def _differentiable(kernel, fmt: str):

  @jax.custom_vjp
  def grouped(lhs, codes, scales, group_sizes):
    return kernel(lhs, codes, scales, group_sizes, fmt=fmt, transpose=False)

  def forward(lhs, codes, scales, group_sizes):
    out = grouped(lhs.value, codes.value, scales.value, group_sizes.value)
    # A static marker (an empty tuple or None): residual leaves must be arrays.
    lhs_marker = () if lhs.perturbed else None
    return out, (codes.value, scales.value, group_sizes.value, lhs_marker)

  def backward(residuals, dout):
    codes, scales, group_sizes, lhs_marker = residuals
    if isinstance(dout, SymbolicZero) or lhs_marker is None:
      return None, None, None, None
    dlhs = kernel(dout.astype(jnp.bfloat16), codes, scales, group_sizes, fmt=fmt, transpose=True)
    return dlhs, None, None, None

  grouped.defvjp(forward, backward, symbolic_zeros=True)
  return grouped


def make_quantized_grouped_matmul(kernel):
  """Build quantized_grouped_matmul(lhs, codes, scales, group_sizes, *, fmt) on `kernel`
    (see the module doc)."""
  ops = {name: _differentiable(kernel, name) for name in formats.FORMATS}

  def quantized_grouped_matmul(lhs, codes, scales, group_sizes, *, fmt: str):
    """lhs [M, K] bf16 (rows sorted by group), packed weights codes/scales [G, N, ...] of format
      `fmt`, group_sizes [G] int -> [M, N] bf16, row i = lhs[i] @ W[g(i)]^T
      (rows past sum(group_sizes): 0)."""
    check_quantized_grouped_matmul_inputs(lhs, codes, scales, group_sizes, fmt)
    return ops[fmt](lhs, codes, scales, group_sizes.astype(jnp.int32))

  return quantized_grouped_matmul


def make_quantized_matmul(quantized_grouped_matmul):
  """x [..., K] @ W^T for ONE packed matrix: the grouped op with one group of all rows."""

  def quantized_matmul(x, codes, scales, *, fmt: str):
    """x [..., K] bf16, packed weight codes/scales of one [N, K] matrix -> [..., N]."""
    check_quantized_matmul_inputs(x, codes, scales, fmt)
    rows = x.reshape(-1, x.shape[-1])
    sizes = jnp.full((1,), rows.shape[0], jnp.int32)
    out = quantized_grouped_matmul(rows, codes[None], scales[None], sizes, fmt=fmt)
    return out.reshape(*x.shape[:-1], codes.shape[0])

  return quantized_matmul

"""Matmuls against packed weights as a loop over the groups: exact, with the memory of a
grouped GPU kernel, for XLA:CPU (a compile on CPU that stands in for a GPU step).

Step g dequantizes only W[g] ([N, K] bf16, formats.dequantize), multiplies every row by
it and keeps the rows of group g, so what is alive is the output, one product, one
dequantized weight and the operands: never a bf16 copy of the whole stack. The backward
is the same custom VJP as the kernel's (quantized_matmul.py): the input gradient is the
same loop with the transposed product. It costs G times the FLOPs of the grouped
product: a memory-faithful stand-in, not a fast path.
"""

import jax
import jax.numpy as jnp

from . import formats
from .formats import dequantize
from .quantized_matmul import make_quantized_grouped_matmul, make_quantized_matmul


def loop_product(x, codes, scales, group_sizes, *, fmt: str, transpose: bool):
  """The kernel contract of make_quantized_grouped_matmul, one group at a time."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  starts = ends - group_sizes
  rows = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]
  # forward: x [M, K] . W [N, K] over K; transposed: x [M, N] . W [N, K] over N
  contract = ((1,), (0,)) if transpose else ((1,), (1,))

  def product(g):
    w = dequantize(codes[g], scales[g], fmt, jnp.bfloat16)
    # Written in x's dtype with fp32 accumulation inside the product: no fp32 [M, N] copy.
    return jax.lax.dot_general(x, w.astype(x.dtype), (contract, ((), ())),
                               preferred_element_type=x.dtype)

  def mine(g):
    return (rows >= starts[g]) & (rows < ends[g])

  def one_group(g, out):
    return jnp.where(mine(g), product(g), out)

  if codes.shape[0] == 0:  # no groups: every row is past them
    k = codes.shape[2] * formats.get(fmt).per_code
    return jnp.zeros((x.shape[0], k if transpose else codes.shape[1]), x.dtype)
  # Group 0's rows from its product, every other row 0 (a fused select, not a hoisted
  # [M, N] constant); each later group overwrites its own rows.
  first = jnp.where(mine(0), product(0), jnp.zeros((), x.dtype))
  return jax.lax.fori_loop(1, codes.shape[0], one_group, first)


loop_quantized_grouped_matmul = make_quantized_grouped_matmul(loop_product)
loop_quantized_matmul = make_quantized_matmul(loop_quantized_grouped_matmul)

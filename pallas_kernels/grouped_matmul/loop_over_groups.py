"""Grouped matmul as a loop over the groups: exact, with a GPU kernel's memory footprint.

XLA:CPU lowers `jax.lax.ragged_dot` to one dense product per group: a [G, M, N] fp32
output and masked [G, M, K] copies of the rows, G times what a grouped GPU kernel
allocates. A compile on CPU that stands in for a GPU step (the dry run) must not see
those. Here the groups are visited one at a time: step g multiplies the rows by rhs[g]
and keeps the rows of group g, so what is alive is the [M, N] output, one [M, N]
product and the operands, as for the Mosaic kernel.

The backward is `make_grouped_matmul`'s custom VJP: the input gradient is the same loop
against rhs[g]^T; the weight gradient, only when rhs is perturbed, one [K, N] product per
group. The residuals are the operands (lhs only when rhs needs a gradient), as for the
Mosaic path. It costs G times the FLOPs of ragged_dot: a memory-faithful stand-in, not
a fast path.

Weight gradients contract over the rows (lhs^T @ dout). XLA:CPU runs such a product in
fp32, converting both operands whole ([327,680, 7168] rows: a 9.4 GB copy); a GPU's
matmul reads bf16 as it is. So these products go through `row_blocked_weight_gradient`,
which sums them over blocks of rows: the conversion is one block's.
"""

import jax
import jax.numpy as jnp

from .grouped_matmul import make_grouped_matmul


def _row_bounds(group_sizes):
  ends = jnp.cumsum(group_sizes)
  return ends - group_sizes, ends


def _loop_product(lhs, rhs, group_sizes, *, transpose_rhs: bool):
  """[M, N] with row i = lhs[i] @ rhs[g(i)] (rhs[g]^T when transpose_rhs); rows past
    sum(group_sizes) are left to `make_grouped_matmul`, which zeroes them."""
  starts, ends = _row_bounds(group_sizes)
  rows = jnp.arange(lhs.shape[0], dtype=jnp.int32)[:, None]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))

  def one_group(g, out):
    # Written in lhs's dtype, as the Mosaic kernel writes it (fp32 accumulation inside
    # the product): no fp32 [M, N] copy.
    product = jax.lax.dot_general(lhs, rhs[g].astype(lhs.dtype), (contract, ((), ())),
                                  preferred_element_type=lhs.dtype)
    mine = (rows >= starts[g]) & (rows < ends[g])
    return jnp.where(mine, product, out)

  if rhs.shape[0] == 0:
    return jnp.zeros((lhs.shape[0], n), lhs.dtype)
  # The loop starts from group 0's product for every row: no [M, N] of zeros (XLA
  # hoists such a constant out of every loop, and it stays alive), and the carry is
  # typed like every product (inside a shard_map: varying over the same mesh axes).
  # Each row is then overwritten by its group's product.
  first = jax.lax.dot_general(lhs, rhs[0].astype(lhs.dtype), (contract, ((), ())),
                              preferred_element_type=lhs.dtype)
  return jax.lax.fori_loop(1, rhs.shape[0], one_group, first)


ROW_BLOCK = 8192


def row_blocked_weight_gradient(lhs, dout, row_mask=None, block: int = ROW_BLOCK):
  """lhs^T @ dout ([M, K], [M, N] -> [K, N] fp32) summed over blocks of `block` rows;
    rows where `row_mask` ([M] bool) is False are left out."""
  m = lhs.shape[0]
  block = min(block, m)
  pad = -m % block
  if row_mask is None:
    row_mask = jnp.ones((m,), bool)
  if pad:
    lhs, dout = (jnp.pad(t, ((0, pad), (0, 0))) for t in (lhs, dout))
    row_mask = jnp.pad(row_mask, (0, pad))

  def one_block(i, acc):
    rows = jax.lax.dynamic_slice_in_dim(lhs, i * block, block)
    grads = jax.lax.dynamic_slice_in_dim(dout, i * block, block)
    keep = jax.lax.dynamic_slice_in_dim(row_mask, i * block, block)[:, None]
    grads = jnp.where(keep, grads, jnp.zeros((), grads.dtype))
    return acc + jax.lax.dot_general(rows, grads,
                                     (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

  first = one_block(0, jnp.zeros((lhs.shape[1], dout.shape[1]), jnp.float32))
  return jax.lax.fori_loop(1, lhs.shape[0] // block, one_block, first)


def _loop_weight_gradient(lhs, dout, group_sizes, num_groups):
  """[G, K, N] fp32 with entry g = lhs_g^T @ dout_g (rows past the groups ignored)."""
  starts, ends = _row_bounds(group_sizes)
  rows = jnp.arange(lhs.shape[0], dtype=jnp.int32)

  def one_group(g):
    return row_blocked_weight_gradient(lhs, dout, (rows >= starts[g]) & (rows < ends[g]))

  return jax.lax.map(one_group, jnp.arange(num_groups, dtype=jnp.int32))


_loop_grouped_matmul = make_grouped_matmul(_loop_product, _loop_weight_gradient)


def loop_grouped_matmul(lhs, rhs, group_sizes):
  """lhs [M, K], rhs [G, K, N], group_sizes [G] int -> [M, N] in lhs's dtype (rows past
    the groups: 0); equal to `jax.lax.ragged_dot`."""
  return _loop_grouped_matmul(lhs, rhs, group_sizes)


@jax.custom_vjp
def _matmul_blocked_weight_gradient(x, w):
  """x [M, K] @ w [K, N] in x's dtype; w's gradient by `row_blocked_weight_gradient`."""
  return jnp.dot(x, w.astype(x.dtype), preferred_element_type=x.dtype)


def _matmul_forward(x, w):
  return _matmul_blocked_weight_gradient(x, w), (x, w)


def _matmul_backward(residuals, dout):
  x, w = residuals
  dout = dout.astype(x.dtype)
  dx = jax.lax.dot_general(dout, w.astype(x.dtype), (((1,), (1,)), ((), ())),
                           preferred_element_type=x.dtype)
  return dx, row_blocked_weight_gradient(x, dout).astype(w.dtype)


_matmul_blocked_weight_gradient.defvjp(_matmul_forward, _matmul_backward)


def _make_loop_grouped_lora():
  from .grouped_lora import make_grouped_lora
  return make_grouped_lora(loop_grouped_matmul, matmul=_matmul_blocked_weight_gradient)


# scale * (x @ a[g]) @ b[g] as the GPU path computes it (dense for small G * r; its
# weight gradients summed over row blocks), with this loop past that size.
loop_grouped_lora = _make_loop_grouped_lora()

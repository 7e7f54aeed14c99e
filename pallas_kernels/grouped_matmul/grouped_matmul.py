"""Differentiable grouped matmul on a pluggable forward kernel.

`make_grouped_matmul(kernel)` wraps a kernel with the contract
    kernel(lhs [M, K], rhs [G, K, N] (or [G, N, K] with transpose_rhs=True), group_sizes)
      -> [M, N], rows at or past sum(group_sizes) unspecified
in a `jax.custom_vjp`:
  * the output rows past sum(group_sizes) are zeroed here (in place, tail blocks only);
  * d lhs = dout @ rhs[g]^T per group, through the same fast kernel with transpose_rhs
    (no transposed copy of the weights);
  * d rhs[g] = lhs_g^T @ dout_g through `jax.lax.ragged_dot_general` (ragged contraction),
    computed only when rhs is perturbed (symbolic zeros): frozen base weights cost no
    weight-gradient work and keep no lhs residual.
Tests swap the kernel for `jax.lax.ragged_dot` to check this logic on CPU.
"""

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from .input_checks import check_grouped_matmul_inputs


def zero_rows_past_groups(out, group_sizes):
  """Rows at or past sum(group_sizes) belong to no group: set them to zero.

    A full-array select would cost a read and a write of the whole output (measured:
    docs/kernel_tuning.md, "Zeroing rows past the groups"); instead only the row blocks
    from the one holding sum(group_sizes) to the end are rewritten, in place, so the
    common case sum(group_sizes) == M costs nothing.
    """
  m = out.shape[0]
  block = next(b for b in (128, 64, 32, 16, 8, 4, 2, 1) if m % b == 0)
  total = jnp.sum(group_sizes).astype(jnp.int32)
  in_block = jnp.arange(block, dtype=jnp.int32)[:, None]

  # Inside shard_map the group sizes vary over the mesh axes while a kernel's output may
  # be typed as replicated; the loop carry must keep one type, so give out total's.
  varying = lambda x: jax.typeof(x).manual_axis_type.varying
  missing = tuple(sorted(varying(total) - varying(out)))
  if missing:
    out = jax.lax.pcast(out, missing, to="varying")

  def zero_block(i, out):
    start = i * block
    rows = jax.lax.dynamic_slice_in_dim(out, start, block)
    rows = jnp.where(start + in_block < total, rows, jnp.zeros((), out.dtype))
    return jax.lax.dynamic_update_slice_in_dim(out, rows, start, 0)

  return jax.lax.fori_loop(jnp.minimum(total, m) // block, m // block, zero_block, out)


def grouped_weight_gradient(lhs, dout, group_sizes, num_groups=None):
  """d rhs [G, K, N] with d rhs[g] = lhs_g^T @ dout_g (rows past the groups ignored)."""
  del num_groups  # ragged_dot_general reads G from group_sizes
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())),
      lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[],
  )
  return jax.lax.ragged_dot_general(lhs, dout, group_sizes, dims,
                                    preferred_element_type=jnp.float32)


def make_grouped_matmul(kernel, weight_gradient=grouped_weight_gradient):
  """Build grouped_matmul(lhs, rhs, group_sizes) -> [M, N] on `kernel` (see module doc);
    `weight_gradient(lhs, dout, group_sizes, num_groups) -> [G, K, N]` is the rhs gradient."""

  @jax.custom_vjp
  def _grouped(lhs, rhs, group_sizes):
    return zero_rows_past_groups(kernel(lhs, rhs, group_sizes, transpose_rhs=False), group_sizes)

  def _forward(lhs, rhs, group_sizes):
    out = _grouped(lhs.value, rhs.value, group_sizes.value)
    # lhs is only needed for the weight gradient; frozen weights keep nothing.
    saved_lhs = lhs.value if rhs.perturbed else None
    # A static marker (an empty tuple or None): residual leaves must be arrays.
    lhs_marker = () if lhs.perturbed else None
    return out, (saved_lhs, rhs.value, group_sizes.value, lhs_marker)

  def _backward(residuals, dout):
    saved_lhs, rhs, group_sizes, lhs_marker = residuals
    if isinstance(dout, SymbolicZero):
      return None, None, None
    dout = dout.astype(rhs.dtype)
    dlhs = None
    if lhs_marker is not None:
      dlhs = zero_rows_past_groups(kernel(dout, rhs, group_sizes, transpose_rhs=True), group_sizes)
    drhs = None
    if saved_lhs is not None:
      drhs = weight_gradient(saved_lhs, dout, group_sizes, rhs.shape[0]).astype(rhs.dtype)
    return dlhs, drhs, None

  _grouped.defvjp(_forward, _backward, symbolic_zeros=True)

  def grouped_matmul(lhs, rhs, group_sizes):
    """lhs [M, K], rhs [G, K, N], group_sizes [G] int -> [M, N] (rows past the groups: 0)."""
    check_grouped_matmul_inputs(lhs, rhs, group_sizes)
    return _grouped(lhs, rhs, group_sizes.astype(jnp.int32))

  return grouped_matmul

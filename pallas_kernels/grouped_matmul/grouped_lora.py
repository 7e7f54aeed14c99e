"""Per-expert LoRA product scale * (x @ a[g]) @ b[g] for small ranks.

With rank r the two products are thin (N = r, then K = r): far too thin for the Mosaic
kernel's 128-wide tiles, and XLA's ragged_dot is slow. When G * r is small (14 experts x
rank 16 = 224 columns) both are done as dense matmuls against all experts' factors at
once, with each row keeping only its own expert's slice:
    h_all = x @ [a_0 | ... | a_{G-1}]          [M, G*r]   (G times the FLOPs of x @ a_g,
    h     = h_all[row, group(row)]             [M, r]      still a thin, memory-bound pass)
    out   = onehot(group) (x) h @ [b_0; ...; b_{G-1}]      [M, N]
Rows past sum(group_sizes) have an all-zero one-hot, so their output is zero. Everything
is plain differentiable JAX; gradients of x, a and b come from autodiff of dense matmuls.
Every product is written in x's dtype (fp32 accumulation inside the matmul): the one-hot
selections are exact, and the backward's cotangents stay in x's dtype, so it holds no
fp32 [M, K] or [M, N] copy (at M = 327,680 rows, K = 7168: 9.4 GB each).
Past `max_dense_columns` the grouped matmul (kernel + ragged_dot fallback) is used.
"""

import jax.numpy as jnp

from .input_checks import check_grouped_lora_inputs

MAX_DENSE_COLUMNS = 2048


def row_group_one_hot(group_sizes, num_rows: int, dtype):
  """[M, G] one-hot of each row's group; rows past sum(group_sizes) are all zero."""
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  rows = jnp.arange(num_rows, dtype=ends.dtype)[:, None]
  return ((rows >= starts[None, :]) & (rows < ends[None, :])).astype(dtype)


def matmul_in_dtype(x, w):
  """x [M, K] @ w [K, N] written in x's dtype."""
  return jnp.dot(x, w.astype(x.dtype), preferred_element_type=x.dtype)


def dense_grouped_lora(x, a, b, group_sizes, scale, matmul=matmul_in_dtype):
  num_groups, k, rank = a.shape
  dtype = x.dtype
  one_hot = row_group_one_hot(group_sizes, x.shape[0], dtype)  # [M, G]
  a_all = jnp.transpose(a, (1, 0, 2)).reshape(k, num_groups * rank)  # [K, G*r]
  h_all = matmul(x, a_all)  # [M, G*r]
  h = jnp.einsum("mgr,mg->mr", h_all.reshape(-1, num_groups, rank), one_hot,
                 preferred_element_type=dtype)  # [M, r]
  h_spread = (one_hot[:, :, None] * h[:, None, :]).reshape(-1, num_groups * rank)
  b_all = (scale * b.reshape(num_groups * rank, -1).astype(jnp.float32)).astype(dtype)
  return matmul(h_spread, b_all)  # [M, N]


def make_grouped_lora(grouped_matmul, matmul=matmul_in_dtype):
  """Build grouped_lora(x, a, b, group_sizes, scale) -> [M, N] (`matmul`: the dense
    products of the small-G * r path)."""

  def grouped_lora(x, a, b, group_sizes, scale, *, max_dense_columns=MAX_DENSE_COLUMNS):
    """scale * (x @ a[g]) @ b[g]: x [M, K], a [G, K, r], b [G, r, N], group_sizes [G]."""
    check_grouped_lora_inputs(x, a, b, group_sizes)
    group_sizes = group_sizes.astype(jnp.int32)
    if a.shape[0] * a.shape[2] <= max_dense_columns:
      return dense_grouped_lora(x, a, b, group_sizes, scale, matmul)
    hidden = grouped_matmul(x, a, group_sizes)
    return (scale * grouped_matmul(hidden, b, group_sizes)).astype(x.dtype)

  return grouped_lora

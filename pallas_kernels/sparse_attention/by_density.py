"""The sparse-attention implementation chosen by how dense the selection is.

Cost model: the gather kernels' forward + backward costs about GATHER_NS per (query,
selected key, KV head); masked dense attention about DENSE_NS per (query, key, query
head) pair it computes (the causal pass, which the indexer's selections take, computes
half the pairs). Both constants come from measurements: docs/kernel_tuning.md, "Masked
dense or gather". The dense cost grows with T^2 and the gather cost with T * K, so for
the target's heads and K = 2048 dense wins at short T and the gather at long T.
Past MASK_BYTES of selection mask, or where the fused kernel does not apply (fp32, odd
lengths, head dims over 256), the gather kernels run.
"""
import jax.numpy as jnp

from pallas_kernels.sparse_attention.masked_dense import FUSED_DTYPES, masked_dense_attention
from pallas_kernels.sparse_attention.sparse_attention_vjp import sparse_attention

GATHER_NS = 51.58e6 / (8192 * 2048 * 8)
DENSE_NS = 17.22e6 / (8192 * 8192 / 2 * 64)
MASK_BYTES = 4 << 30


def prefers_dense(q_shape, k_shape, top_k: int, dtype) -> bool:
  """Whether masked dense attention is expected to beat the gather kernels."""
  b, t, hq, d = q_shape
  tk, hk = k_shape[1], k_shape[2]
  fused = (jnp.dtype(dtype) in map(jnp.dtype, FUSED_DTYPES) and d % 8 == 0 and d <= 256 and
           t % 2 == 0 and tk % 2 == 0)
  mask_ok = 2 * b * t * tk <= MASK_BYTES  # the bf16 bias the attention builds from it
  pairs = t * tk / 2 if t == tk else t * tk  # the causal pass, or every pair of a range
  return fused and mask_ok and pairs * hq * DENSE_NS < t * top_k * hk * GATHER_NS


def sparse_attention_by_density(q, k, v, indices, *, scale=None):
  """sparse_attention's contract; masked dense attention where prefers_dense says so."""
  if prefers_dense(q.shape, k.shape, indices.shape[2], q.dtype):
    return masked_dense_attention(q, k, v, indices, scale=scale)
  return sparse_attention(q, k, v, indices, scale=scale)

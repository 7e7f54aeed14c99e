"""The sparse-attention implementation chosen by how dense the selection is.

Cost model, measured on the H200 (64 query / 8 KV heads, D = 128, K = 2048,
docs/performance.md): the gather kernels' forward + backward costs about GATHER_NS
per (query, selected key, KV head) (215.9 ms at T = 32768, 57.7 at 8192); masked dense
attention, which cannot skip the pairs past the query, about DENSE_NS per (query, key,
query head) (418.5 ms at 32768, 25.6 at 8192). The dense cost grows with Tk^2 and the
gather cost with Tk * K, so dense wins while Tk * HQ * DENSE_NS < K * HK * GATHER_NS:
for the target's heads and K = 2048, up to Tk ~ 16K (2.25x faster at 8192). Past
MASK_BYTES of selection mask, or where the fused kernel does not apply (fp32, odd
lengths, head dims over 256), the gather kernels run.
"""
import jax.numpy as jnp

from pallas_kernels.sparse_attention.masked_dense import FUSED_DTYPES, masked_dense_attention
from pallas_kernels.sparse_attention.sparse_attention_vjp import sparse_attention

GATHER_NS = 215.9e6 / (32768 * 2048 * 8)
DENSE_NS = 418.5e6 / (32768 * 32768 * 64)
MASK_BYTES = 4 << 30


def prefers_dense(q_shape, k_shape, top_k: int, dtype) -> bool:
    """Whether masked dense attention is expected to beat the gather kernels."""
    b, t, hq, d = q_shape
    tk, hk = k_shape[1], k_shape[2]
    fused = (jnp.dtype(dtype) in map(jnp.dtype, FUSED_DTYPES) and d % 8 == 0 and d <= 256
             and t % 2 == 0 and tk % 2 == 0)
    mask_ok = 2 * b * t * tk <= MASK_BYTES  # the bf16 bias the attention builds from it
    return fused and mask_ok and tk * hq * DENSE_NS < top_k * hk * GATHER_NS


def sparse_attention_by_density(q, k, v, indices, *, scale=None):
    """sparse_attention's contract; masked dense attention where prefers_dense says so."""
    if prefers_dense(q.shape, k.shape, indices.shape[2], q.dtype):
        return masked_dense_attention(q, k, v, indices, scale=scale)
    return sparse_attention(q, k, v, indices, scale=scale)

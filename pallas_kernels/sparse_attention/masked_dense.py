"""Top-K sparse attention as dense fused attention under the selection mask.

Where the selection covers a large share of the keys (training lengths: at T = 8192
and K = 2048 a query selects half of its causal prefix on average), one fused dense
attention kernel over every (query, key) pair with the unselected pairs masked out
beats gathering each query's keys: its K/V tiles are loaded once per query tile and
serve every query of it, where the gather loads each selected row once per query. On
GPU the kernel is cuDNN's flash attention; elsewhere XLA's attention (same result).

Exact: the softmax runs over the selected keys only, and a query with no valid index
outputs zeros, as in the reference. The selection is read as a set (a key listed
twice counts once; the indexer never lists one twice). The mask is [B, 1, T, Tk]
(one byte per pair, two once the attention turns it into an additive bias), so this
path is for lengths where that fits: see by_density.py for the choice. Selections that
stay at or before their query (the indexer's) let the kernel skip the pairs past the
diagonal.
"""
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import residuals
from pallas_kernels.sparse_attention import input_checks

FUSED_DTYPES = (jnp.bfloat16, jnp.float16)


def selection_mask(indices, num_keys):
  """bool [B, 1, T, num_keys]: True where key s is among indices[b, t] (-1 ignored)."""
  b, t, _ = indices.shape
  # -1 (unused) goes out of range and is dropped by the scatter
  cols = jnp.where(indices >= 0, indices, num_keys)
  rows = jnp.arange(t, dtype=jnp.int32)[None, :, None]
  batch = jnp.arange(b, dtype=jnp.int32)[:, None, None]
  mask = jnp.zeros((b, t, num_keys), jnp.bool_)
  mask = mask.at[batch, rows, cols].set(True, mode="drop", unique_indices=False)
  return mask[:, None]


def masked_dense_attention(q, k, v, indices, *, scale=None, implementation=None):
  """Same contract as sparse_attention (q [B,T,HQ,D], k/v [B,Tk,HK,D], indices [B,T,K]).

    implementation: "cudnn" or "xla" (jax.nn.dot_product_attention); default cuDNN on GPU
    for bf16/f16, XLA otherwise.
    """
  input_checks.check_attention_inputs(q, k, v, indices)
  if implementation is None:
    fused = jax.default_backend() == "gpu" and q.dtype in FUSED_DTYPES
    implementation = "cudnn" if fused else "xla"
  mask = selection_mask(indices, k.shape[1])
  t = q.shape[1]
  # The indexer selects keys s <= t only; then the kernel may skip every tile past the
  # diagonal (half the pairs). A selection past its query, which the contract allows,
  # takes the full pass; so does a range of the queries (positions unknown here).
  causal = (jnp.all(
      indices <= jnp.arange(t, dtype=indices.dtype)[None, :, None]) if k.shape[1] == t else None)
  o = _attention_keeping_residuals(q, k, v, mask, causal, scale, implementation)
  has_keys = jnp.any(indices >= 0, axis=-1)[:, :, None, None]
  return jnp.where(has_keys, o, 0).astype(q.dtype)


def _attention(q, k, v, mask, causal, scale, implementation):

  def attend(is_causal):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=
                                                        is_causal, implementation=implementation)

  if causal is None:
    return attend(False)(q, k, v)
  return jax.lax.cond(causal, attend(True), attend(False), q, k, v)


# jax's fused attention keeps its residuals (output, softmax statistics, the mask as a
# bias) unnamed, so inside the model's remat policies its forward would run again in the
# backward; this wrapper names them as the attention core's residuals (see
# pallas_kernels/residuals.py), as the Pallas kernels do.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention_keeping_residuals(q, k, v, mask, causal, scale, implementation):
  return _attention(q, k, v, mask, causal, scale, implementation)


def _attention_fwd(q, k, v, mask, causal, scale, implementation):
  o, pullback = jax.vjp(lambda q, k, v: _attention(q, k, v, mask, causal, scale, implementation), q,
                        k, v)
  return o, jax.tree.map(lambda a: residuals.keep(a)[0], pullback)


def _attention_bwd(scale, implementation, pullback, do):
  return (*pullback(do), None, None)


_attention_keeping_residuals.defvjp(_attention_fwd, _attention_bwd)

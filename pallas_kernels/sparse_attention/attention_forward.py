"""Pallas (Triton) forward kernel of top-K sparse attention.

One program per (batch, query, KV head). It gathers the selected K/V rows of its KV
head block by block (an int-array index into the ref) and runs an online softmax for
all the query heads that share that KV head, so every gathered row is loaded once and
serves the whole head group. The log-sum-exp is kept for the backward pass.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_MASKED = -1e30  # finite, so masked blocks never produce inf - inf


def _forward_kernel(q_ref, idx_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, block_k):
  q = q_ref[...]  # [Gp, D]: the query heads of one KV head (zero rows pad to Gp)
  rows = q.shape[0]
  n_blocks = idx_ref.shape[0] // block_k

  def body(i, carry):
    acc, m, l = carry
    idx = idx_ref[pl.ds(i * block_k, block_k)]
    valid = idx >= 0
    safe = jnp.where(valid, idx, 0)
    k_rows = k_ref[safe, :]  # gather [block_k, D]
    v_rows = v_ref[safe, :]
    s = plgpu.dot(q, k_rows, trans_b=True).astype(jnp.float32) * scale
    m_new = jnp.maximum(m, jnp.max(jnp.where(valid[None, :], s, _MASKED), axis=1))
    p = jnp.where(valid[None, :], jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(v_rows.dtype), v_rows).astype(jnp.float32)
    return acc, m_new, l

  init = (jnp.zeros(q.shape, jnp.float32), jnp.full((rows,), _MASKED,
                                                    jnp.float32), jnp.zeros((rows,), jnp.float32))
  acc, m, l = jax.lax.fori_loop(0, n_blocks, body, init)
  has_keys = l > 0
  o_ref[...] = (acc / jnp.where(has_keys, l, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(has_keys, m + jnp.log(jnp.where(has_keys, l, 1.0)), 0.0)


def sparse_attention_forward(q_groups, k_heads, v_heads, indices, *, scale, block_k, interpret,
                             num_warps=4, num_stages=2):
  """q_groups [B,T,HK,Gp,D], k/v_heads [B,HK,Tk,D], indices [B,T,Kp] (Kp % block_k == 0).

    Returns o [B,T,HK,Gp,D] (q dtype) and lse [B,T,HK,Gp] (fp32).
    """
  b, t, hk, gp, d = q_groups.shape
  kp, tk = indices.shape[2], k_heads.shape[2]
  kernel = functools.partial(_forward_kernel, scale=scale, block_k=block_k)
  per_query = lambda bi, ti, hi: (bi, ti, hi, 0, 0)
  whole_head = lambda bi, ti, hi: (bi, hi, 0, 0)
  return pl.pallas_call(
      kernel,
      grid=(b, t, hk),
      in_specs=[
          pl.BlockSpec((None, None, None, gp, d), per_query),
          pl.BlockSpec((None, None, kp), lambda bi, ti, hi: (bi, ti, 0)),
          pl.BlockSpec((None, None, tk, d), whole_head),
          pl.BlockSpec((None, None, tk, d), whole_head),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, gp, d), per_query),
          pl.BlockSpec((None, None, None, gp), lambda bi, ti, hi: (bi, ti, hi, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct(q_groups.shape, q_groups.dtype),
          jax.ShapeDtypeStruct((b, t, hk, gp), jnp.float32)
      ],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="sparse_attention_forward",
  )(q_groups, indices, k_heads, v_heads)

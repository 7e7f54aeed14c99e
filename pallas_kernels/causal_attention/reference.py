"""Plain-JAX reference for causal softmax attention over packed documents.

    o[b, t, h] = sum_s softmax_s(scale * q[b, t, h] . k[b, s, h]) v[b, s, h]

over the keys s <= t of t's segment (segment_ids[b, s] == segment_ids[b, t]). One key head
per query head; the value head dim may differ from the query/key head dim. Queries are
taken block_q at a time, so memory grows with block_q * T rather than T * T, and each
block's scores are recomputed in the backward rather than kept. Softmax in fp32;
differentiable in q, k, v by autodiff.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.causal_attention import input_checks

_NEG_INF = float("-inf")


def _pad_seq(x, multiple: int, value=0):
  pad = -x.shape[1] % multiple
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def causal_attention_reference(q, k, v, *, segment_ids=None, scale=None, block_q: int = 64):
  """Causal attention within segments, [B, T, H, Dv] in q's dtype.

    Args:
      q, k: [B, T, H, Dk].
      v: [B, T, H, Dv].
      segment_ids: optional int [B, T]; tokens attend only within their segment.
      scale: softmax scale, default Dk ** -0.5.
      block_q: queries scored at a time.
    """
  input_checks.check_inputs(q, k, v, segment_ids, block_q)
  b, t, h, dk = q.shape
  scale = dk**-0.5 if scale is None else scale
  block_q = min(block_q, t)
  seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  n_blocks = -(-t // block_q)
  # [n_blocks, B, block_q, ...]; padded queries belong to no segment and are dropped
  q_blocks = _pad_seq(q, block_q).reshape(b, n_blocks, block_q, h, dk).swapaxes(0, 1)
  seg_blocks = _pad_seq(seg, block_q, -1).reshape(b, n_blocks, block_q).swapaxes(0, 1)
  starts = jnp.arange(n_blocks, dtype=jnp.int32) * block_q
  cols = jnp.arange(t, dtype=jnp.int32)

  @jax.checkpoint  # the backward keeps no per-block scores alive
  def one_block(args):
    start, q_blk, seg_blk = args
    s = jnp.einsum("bqhd,bshd->bhqs", q_blk, k, preferred_element_type=jnp.float32) * scale
    rows = start + jnp.arange(block_q, dtype=jnp.int32)
    ok = (cols[None, None, :] <= rows[None, :, None]) & (seg_blk[:, :, None] == seg[:, None, :])
    ok = ok[:, None]  # [B, 1, bq, T]
    s = jnp.where(ok, s, _NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a row with no key: all p = 0
    p = jnp.where(ok, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("bhqs,bshd->bqhd", p, v, preferred_element_type=jnp.float32)
    return o.astype(q.dtype)

  out = jax.lax.map(one_block, (starts, q_blocks, seg_blocks))  # [n_blocks, B, bq, H, Dv]
  return out.swapaxes(0, 1).reshape(b, n_blocks * block_q, h, v.shape[-1])[:, :t]

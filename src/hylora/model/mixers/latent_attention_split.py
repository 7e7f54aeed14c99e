"""MLA's full attention on a sequence split across devices (context parallelism).

Each device holds a range of the sequence. It all-gathers the compressed keys along the
sequence, never K and V: the normed kv latent [B, T, kv_rank], the shared rope key
[B, T, rope_dim] (already rotated) and the segment ids. It keeps its own queries
[B, T_local, H, nope + rope] and attends, causally by global position (its first query
sits at device index x T_local) and within each document (same segment id), to the
gathered keys one block of `block_k` keys at a time: the block's latent goes through
kv_b_proj (the module itself, so its LoRA adapter and a packed base weight work as
everywhere else) to K_nope and V, scores against the local queries, and is dropped.
No array spans all keys times heads: not K/V, not the [T_local, T] scores.

The attention is a custom VJP, flash attention's, so its gradient keeps nothing per key
block: only its inputs, o and lse = logsumexp of each (query, head)'s scores.

  forward:  one `lax.scan` over the key blocks, an online max, sum and weighted sum of V.
  backward: one `lax.scan` over the key blocks. Each block's K/V is up-projected again
            from its latent; P = exp(S - lse), dV = P^T dO, dS = P * (dO V^T - delta)
            with delta = rowsum(dO * o), dq += dS K, dK = dS^T q; the up-projection's
            pullback turns [dK_nope | dV] into the block latent's gradient and the
            weights' (summed in fp32 over the blocks).

The forward runs under `jax.checkpoint` (nothing saved): linearizing a caller's scan (the
layer stack) hoists the work that depends only on its loop-invariant integer inputs out
of the loop, and the attention's masks would come out of it stacked, one per key block.

Blocks wholly in the future of every query a device scores are skipped (`lax.cond`), in
the backward too, so the work is causal. Causal work grows with a query's position (the
first device's queries see one range of keys, the last's every range), so each device
attends for the queries of half-blocks d and 2P - 1 - d of the sequence's 2P instead of
its own range (meshes.gathered_keys.in_balanced_order: two `ppermute`s of half the
queries there, two of their outputs back), and every device does the same work.

With LoRA dropout, each key block draws its adapter-input mask from the dropout key
folded with the block's start, the same forward and backward and on every device; the
masks differ from the unsplit layer's (which draws one mask for the whole sequence).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from meshes.gathered_keys import in_balanced_order
from meshes.per_shard import sequence_axes, sequence_split

_NEG_INF = float("-inf")

# The key block (MLAConfig.block_k, 256) at K3's shapes, 1M tokens on 128 devices: 8192
# local queries, 96 heads. One block's scores are [B, H, T_local, block_k] fp32 = 96 x 8192
# x 256 x 4 B = 0.8 GB; the backward holds about four such arrays at once (scores,
# probabilities, their cotangents: ~3.2 GB), the forward two. Besides them, per device:
# the gathered latent and rope key, 1M x (512 + 64) bf16 = 1.2 GB, the same again for their
# copy in blocks and for their gradient; the forward's weighted sum [B, T_local, H, v] fp32
# = 0.4 GB and the backward's dq [B, T_local, H, nope + rope] fp32 = 0.6 GB; one block's
# K/V, 256 x 96 x 256 bf16 = 13 MB. About 8 GB in all, against ~60 GB for the whole
# sequence's K/V that gathering K/V would hold. A block of 512 doubles the score arrays
# (6.4 GB in the backward) for half the loop steps, each of which already does ~130 GFLOP
# of matmuls at 256.


def _pad_keys(x: jax.Array, multiple: int, value) -> jax.Array:
  pad = -x.shape[1] % multiple
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.pad(x, widths, constant_values=value) if pad else x


def _varying_like(x: jax.Array, ref: jax.Array) -> jax.Array:
  """x typed as varying over the mesh axes that ref varies over (scan carries and cond
  branches must agree on that with what the body computes from ref)."""
  missing = tuple(sorted(jax.typeof(ref).mat.varying - jax.typeof(x).mat.varying))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def _no_gradient(x):
  """The cotangent of an integer or key input: float0 zeros (None stays None)."""
  return None if x is None else np.zeros(jnp.shape(x), jax.dtypes.float0)


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def attention_over_gathered_keys(up_project, weights, dropout_key, q, latent, k_rope, seg_q, seg_k,
                                 q_offset, *, nope_dim: int, scale: float,
                                 block_k: int) -> jax.Array:
  """Causal attention of local queries q [B, Tq, H, nope + rope] (global positions
  q_offset + 0..Tq-1) over all keys, given as latent [B, T, R], k_rope [B, T, rope] and
  segment ids seg_k [B, T] (seg_q [B, Tq] for the queries); up_project(weights, latent,
  dropout_key) -> [.., H, nope + v]. Returns [B, Tq, H, v] in q's dtype."""
  b = q.shape[0]
  n_blocks = -(-latent.shape[1] // block_k)

  def blocks(x, value=0):
    x = _pad_keys(x, block_k, value)  # padded keys sit after every query: masked
    return x.reshape(b, n_blocks, block_k, *x.shape[2:]).swapaxes(0, 1)

  starts = jnp.arange(n_blocks, dtype=jnp.int32) * block_k
  attend = _blockwise_attention(up_project, nope_dim, scale, block_k)
  return attend(weights, dropout_key, q, blocks(latent), blocks(k_rope), seg_q, blocks(seg_k, -1),
                starts, q_offset)


def _blockwise_attention(up_project, nope_dim: int, scale: float, block_k: int):
  """attend(weights, dropout_key, q, latent_blocks [n, B, block_k, R], rope_blocks
  [n, B, block_k, rope], seg_q, seg_blocks [n, B, block_k], starts [n], q_offset), with its
  flash-attention backward as a custom VJP."""

  def block_up_projection(dropout_key, start):
    """(weights, latent [B, block_k, R]) -> [B, block_k, H, nope + v] for the block at
    start, its dropout mask drawn from the key folded with start."""
    key = None if dropout_key is None else jax.random.fold_in(dropout_key, start)
    return lambda weights, lat: up_project(weights, lat, key)

  def block_scores(kv, q, seg_q, q_offset, rope, seg, start):
    """The block's masked scores [B, H, Tq, block_k] fp32, K_nope and V [B, block_k, H, .]."""
    k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]
    s = jnp.einsum("bqhd,bkhd->bhqk", q[..., :nope_dim], k_nope, preferred_element_type=jnp.float32)
    s = s + jnp.einsum("bqhd,bkd->bhqk", q[..., nope_dim:], rope,
                       preferred_element_type=jnp.float32)
    q_pos = q_offset + jnp.arange(q.shape[1], dtype=jnp.int32)
    k_pos = start + jnp.arange(block_k, dtype=jnp.int32)
    ok = (k_pos[None, None, :] <= q_pos[None, :, None]) & (seg[:, None, :] == seg_q[:, :, None])
    return jnp.where(ok[:, None], s * scale, _NEG_INF), k_nope, v

  def needed(start, q, q_offset):  # a block wholly after the last query is skipped
    return start <= q_offset + q.shape[1] - 1

  def forward(weights, dropout_key, q, lat_blocks, rope_blocks, seg_q, seg_blocks, starts,
              q_offset):
    """o [B, Tq, H, v] and lse [B, H, Tq]: one pass, an online max, sum and weighted sum."""

    def update(carry, block):
      m, l, acc = carry
      lat, rope, seg, start = block
      kv = block_up_projection(dropout_key, start)(weights, lat)
      s, _, v = block_scores(kv, q, seg_q, q_offset, rope, seg, start)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      shift = jnp.where(m_new == _NEG_INF, 0.0, m_new)  # no key yet: every term is 0
      p = jnp.exp(s - shift[..., None])
      rescale = jnp.exp(m - shift)
      pv = jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
      acc = acc * jnp.swapaxes(rescale, 1, 2)[..., None] + pv
      return m_new, l * rescale + jnp.sum(p, axis=-1), acc

    def step(carry, block):
      return jax.lax.cond(needed(block[3], q, q_offset), update, lambda c, _: c, carry, block), None

    b, tq, h, _ = q.shape
    v_dim = jax.eval_shape(lambda w, x: up_project(w, x, None), weights,
                           lat_blocks[0]).shape[-1] - nope_dim
    m0 = _varying_like(jnp.full((b, h, tq), _NEG_INF, jnp.float32), q)
    acc0 = _varying_like(jnp.zeros((b, tq, h, v_dim), jnp.float32), q)
    (m, l, acc), _ = jax.lax.scan(step, (m0, jnp.zeros_like(m0), acc0),
                                  (lat_blocks, rope_blocks, seg_blocks, starts))
    # every query sees at least itself: l > 0
    o = (acc / jnp.swapaxes(l, 1, 2)[..., None]).astype(q.dtype)
    return o, m + jnp.log(l)

  @jax.custom_vjp
  def attend(weights, dropout_key, q, lat_blocks, rope_blocks, seg_q, seg_blocks, starts, q_offset):
    return forward(weights, dropout_key, q, lat_blocks, rope_blocks, seg_q, seg_blocks, starts,
                   q_offset)[0]

  def attend_fwd(*args):
    # Unsaved, so that a caller's linearization cannot stack the masks (module doc).
    o, lse = jax.checkpoint(forward, policy=jax.checkpoint_policies.nothing_saveable)(*args)
    return o, (args, o, lse)

  def attend_bwd(residuals, d_o):
    """One pass over the key blocks: each block's K/V recomputed from its latent, its
    probabilities from lse, and the gradients of q, of the block's latent and rope key,
    and of the up-projection's weights."""
    args, o, lse = residuals
    weights, dropout_key, q, lat_blocks, rope_blocks, seg_q, seg_blocks, starts, q_offset = args
    delta = jnp.sum(d_o.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    delta = jnp.swapaxes(delta, 1, 2)  # [B, H, Tq]
    d_o = d_o.astype(q.dtype)
    w_leaves, w_tree = jax.tree.flatten(weights)
    trained = [i for i, w in enumerate(w_leaves) if _is_float(w)]

    def gradients(carry, block):
      dq, dw = carry
      lat, rope, seg, start = block
      kv, pullback = jax.vjp(block_up_projection(dropout_key, start), weights, lat)
      s, k_nope, v = block_scores(kv, q, seg_q, q_offset, rope, seg, start)
      p = jnp.exp(s - lse[..., None])  # masked keys: exp(-inf) = 0
      dv = jnp.einsum("bhqk,bqhd->bkhd", p.astype(d_o.dtype), d_o,
                      preferred_element_type=jnp.float32)
      dp = jnp.einsum("bqhd,bkhd->bhqk", d_o, v, preferred_element_type=jnp.float32)
      ds = (p * (dp - delta[..., None]) * scale).astype(q.dtype)
      dq_nope = jnp.einsum("bhqk,bkhd->bqhd", ds, k_nope, preferred_element_type=jnp.float32)
      dq_rope = jnp.einsum("bhqk,bkd->bqhd", ds, rope, preferred_element_type=jnp.float32)
      dk_nope = jnp.einsum("bhqk,bqhd->bkhd", ds, q[..., :nope_dim],
                           preferred_element_type=jnp.float32)
      d_rope = jnp.einsum("bhqk,bqhd->bkd", ds, q[..., nope_dim:],
                          preferred_element_type=jnp.float32)
      dw_block, d_lat = pullback(jnp.concatenate([dk_nope, dv], axis=-1).astype(k_nope.dtype))
      dw_leaves = jax.tree.leaves(dw_block)
      dw = [a + dw_leaves[i].astype(jnp.float32) for a, i in zip(dw, trained)]
      dq = dq + jnp.concatenate([dq_nope, dq_rope], axis=-1)
      return (dq, dw), (d_lat.astype(lat.dtype), d_rope.astype(rope.dtype))

    dq0 = _varying_like(jnp.zeros(q.shape, jnp.float32), q)
    dw0 = [_varying_like(jnp.zeros(w_leaves[i].shape, jnp.float32), q) for i in trained]
    block0 = jax.tree.map(lambda x: x[0], (lat_blocks, rope_blocks, seg_blocks, starts))
    ys_shapes = jax.eval_shape(lambda c, blk: gradients(c, blk)[1], (dq0, dw0), block0)

    def skip(carry, block):
      return carry, tuple(_varying_like(jnp.zeros(y.shape, y.dtype), q) for y in ys_shapes)

    def step(carry, block):
      return jax.lax.cond(needed(block[3], q, q_offset), gradients, skip, carry, block)

    (dq, dw), (d_lat, d_rope) = jax.lax.scan(step, (dq0, dw0),
                                             (lat_blocks, rope_blocks, seg_blocks, starts))
    dw_leaves = [_no_gradient(w) for w in w_leaves]
    for a, i in zip(dw, trained):
      dw_leaves[i] = a.astype(w_leaves[i].dtype)
    return (jax.tree.unflatten(w_tree, dw_leaves), _no_gradient(dropout_key), dq.astype(q.dtype),
            d_lat, d_rope, _no_gradient(seg_q), _no_gradient(seg_blocks), _no_gradient(starts),
            _no_gradient(q_offset))

  attend.defvjp(attend_fwd, attend_bwd)
  return attend


def split_sequence_latent_attention(kv_b_proj: nnx.Module, q: jax.Array, latent: jax.Array,
                                    k_rope: jax.Array, segment_ids: jax.Array | None,
                                    dropout_key: jax.Array | None, *, nope_dim: int, scale: float,
                                    block_k: int) -> jax.Array:
  """o [B, T, H, v] of MLA's causal attention within documents, for q [B, T, H, nope +
  rope] (rope part rotated), the normed kv latent [B, T, kv_rank] and the rotated shared
  rope key [B, T, rope], on a sequence the activation rules split over devices (see
  module doc). `kv_b_proj(latent, dropout_key)` expands a latent to [.., H, nope + v]."""
  split = sequence_split(q)
  if split is None:
    raise ValueError("split_sequence_latent_attention: the activation rules do not split "
                     f"the sequence of q {q.shape}")
  if block_k < 1:
    raise ValueError(f"split_sequence_latent_attention: block_k must be >= 1, got {block_k}")
  mesh, rows, seq = split
  seq_axes = sequence_axes(seq)
  devices = math.prod(mesh.shape[a] for a in seq_axes)
  if segment_ids is None:
    segment_ids = jnp.zeros(q.shape[:2], jnp.int32)
  graph, weights = nnx.split(kv_b_proj)
  up_project = lambda weights, latent, key: nnx.merge(graph, weights)(latent, key)

  def body(weights, dropout_key, q, latent, k_rope, seg_q):
    # Typed varying here, once: their gradients' sum over devices then happens here too,
    # not inside the skipped-or-not blocks (where only some devices would join it).
    weights = jax.tree.map(lambda w: _varying_like(w, q), weights)
    gather = lambda x: jax.lax.all_gather(x, seq_axes, axis=1, tiled=True)
    keys = gather(latent), gather(k_rope), gather(seg_q)

    def attend(queries, q_offset):
      return attention_over_gathered_keys(up_project, weights, dropout_key, queries["q"], keys[0],
                                          keys[1], queries["seg_q"], keys[2], q_offset,
                                          nope_dim=nope_dim, scale=scale, block_k=block_k)

    if q.shape[1] % 2 or devices == 1:
      return attend(dict(q=q, seg_q=seg_q), jax.lax.axis_index(seq_axes) * q.shape[1])
    return in_balanced_order(attend, dict(q=q, seg_q=seg_q), seq_axes, devices)

  tokens = P(rows, seq)
  return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), tokens, tokens, tokens, tokens),
                       out_specs=tokens)(weights, dropout_key, q, latent, k_rope,
                                         segment_ids.astype(jnp.int32))

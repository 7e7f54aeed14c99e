"""Pallas (Triton) query-major backward pass of top-K sparse attention: dq.

One program per (batch, query, KV head), mirroring the forward: it re-gathers the
selected K/V rows, rebuilds the probabilities from the saved log-sum-exp and writes
dq of its query heads (each program owns them). With ``atomic_dkdv`` (the default
method) this pass also adds each selected key's dk and dv rows, summed over the query
heads of its KV head first, with relaxed fp32 atomic adds (relaxed_atomics.py); the
key-major pass (attention_backward_by_key.py) is the atomic-free alternative.

With the selection split into key ranges (key_ranges.py), a program per (batch, query,
range, KV head) takes the query's keys of one range, the ranges run one after another,
and each program adds its share of dq into an fp32 table too.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sparse_attention import relaxed_atomics


def _atomic_add_rows(ref, idx, valid, rows, interpret):
  """ref[idx[j]] += rows[j] for the valid j."""
  cols = jax.lax.iota(jnp.int32, rows.shape[1])[None, :]
  if interpret:
    # The interpreter's atomic add takes no mask and treats repeated rows as one:
    # send unused entries (whose rows are zero) to distinct spare rows past the end.
    spare = ref.shape[0] - idx.shape[0] + jax.lax.iota(jnp.int32, idx.shape[0])
    plgpu.atomic_add(ref, (jnp.where(valid, idx, spare)[:, None], cols), rows)
  else:
    mask = jnp.broadcast_to(valid[:, None], rows.shape)
    plgpu.atomic_add(ref, (jnp.where(valid, idx, 0), slice(None)), rows, mask=mask)


def _backward_kernel(q_ref, do_ref, lse_ref, delta_ref, idx_ref, lo_ref, hi_ref, k_ref, v_ref,
                     *out_refs, scale, block_k, atomic_dkdv, ranged, interpret):
  q = q_ref[...]  # [Gp, D]
  do = do_ref[...]
  lse = lse_ref[...]
  delta = delta_ref[...]
  first, end = lo_ref[0], hi_ref[0]  # this program's entries [first, end) of the list

  def body(i, dq):
    pos = i * block_k + jax.lax.iota(jnp.int32, block_k)
    idx = idx_ref[pl.ds(i * block_k, block_k)]
    valid = (idx >= 0) & (pos >= first) & (pos < end)
    safe = jnp.where(valid, idx, 0)
    k_rows = k_ref[safe, :]
    v_rows = v_ref[safe, :]
    s = plgpu.dot(q, k_rows, trans_b=True).astype(jnp.float32) * scale
    p = jnp.where(valid[None, :], jnp.exp(s - lse[:, None]), 0.0)  # [Gp, block_k]
    dp = plgpu.dot(do, v_rows, trans_b=True).astype(jnp.float32)
    ds = (p * (dp - delta[:, None])).astype(q.dtype)
    if atomic_dkdv:
      dk_ref, dv_ref = out_refs[-2:]
      dk_part = plgpu.dot(ds, q, trans_a=True).astype(jnp.float32) * scale
      dv_part = plgpu.dot(p.astype(do.dtype), do, trans_a=True).astype(jnp.float32)
      _atomic_add_rows(dk_ref, idx, valid, dk_part, interpret)
      _atomic_add_rows(dv_ref, idx, valid, dv_part, interpret)
    return dq + plgpu.dot(ds, k_rows).astype(jnp.float32)

  dq = jax.lax.fori_loop(first // block_k, (end + block_k - 1) // block_k, body,
                         jnp.zeros(q.shape, jnp.float32))
  dq_ref = out_refs[-3] if atomic_dkdv else out_refs[-1]
  if ranged:  # the query's other ranges add theirs
    rows = jax.lax.iota(jnp.int32, q.shape[0])
    _atomic_add_rows(dq_ref, rows, rows >= 0, dq * scale, interpret)
  else:
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def sparse_attention_backward(q_groups, k_heads, v_heads, indices, do_groups, lse, delta, *, scale,
                              block_k, interpret, atomic_dkdv=False, ranges=None, num_warps=4,
                              num_stages=2):
  """Shapes as in the forward; do [B,T,HK,Gp,D], lse/delta [B,T,HK,Gp] fp32.

    ranges: None, or (lo, hi) [B, T, R] from key_ranges.split_by_range (indices sorted
    by it; atomic_dkdv only): one pass per key range.

    Returns dq [B,T,HK,Gp,D] (q dtype; fp32 with ranges); with atomic_dkdv also fp32
    dk, dv [B,HK,Tk,D].
    """
  relaxed_atomics.enable()  # before the kernel is lowered: its dk/dv/dq scatters
  b, t, hk, gp, d = q_groups.shape
  kp, tk = indices.shape[2], k_heads.shape[2]
  if ranges is None:
    whole = jnp.zeros((b, t, 1), jnp.int32)
    ranges = (whole, whole + kp)
  elif not atomic_dkdv:
    raise ValueError("key ranges need the atomic dk/dv pass")
  n_ranges = ranges[0].shape[2]
  ranged = n_ranges > 1
  kernel = functools.partial(_backward_kernel, scale=scale, block_k=block_k,
                             atomic_dkdv=atomic_dkdv, ranged=ranged, interpret=interpret)
  # grid (b, t, r, hk): the launch runs (b, t) fastest, so one range (of one head) at a time
  per_query = pl.BlockSpec((None, None, None, gp, d), lambda bi, ti, ri, hi: (bi, ti, hi, 0, 0))
  per_row = pl.BlockSpec((None, None, None, gp), lambda bi, ti, ri, hi: (bi, ti, hi, 0))
  per_range = pl.BlockSpec((None, None, 1), lambda bi, ti, ri, hi: (bi, ti, ri))
  whole_head = pl.BlockSpec((None, None, tk, d), lambda bi, ti, ri, hi: (bi, hi, 0, 0))
  in_specs = [
      per_query, per_query, per_row, per_row,
      pl.BlockSpec((None, None, kp), lambda bi, ti, ri, hi: (bi, ti, 0)), per_range, per_range,
      whole_head, whole_head
  ]
  args = [q_groups, do_groups, lse, delta, indices, *ranges, k_heads, v_heads]
  dq_dtype = jnp.float32 if ranged else q_groups.dtype
  out_shape = [jax.ShapeDtypeStruct(q_groups.shape, dq_dtype)]
  out_specs = [per_query]
  aliases = {}
  if ranged:
    in_specs.append(per_query)
    args.append(jnp.zeros(q_groups.shape, dq_dtype))
    aliases[len(args) - 1] = 0
  if atomic_dkdv:
    # block_k spare rows past the end absorb the interpreter's unused entries.
    acc = jax.ShapeDtypeStruct((b, hk, tk + block_k, d), jnp.float32)
    acc_spec = pl.BlockSpec((None, None, tk + block_k, d), lambda bi, ti, ri, hi: (bi, hi, 0, 0))
    in_specs += [acc_spec, acc_spec]
    args += [jnp.zeros(acc.shape, acc.dtype)] * 2
    out_shape += [acc, acc]
    out_specs += [acc_spec, acc_spec]
    aliases |= {len(args) - 2: 1, len(args) - 1: 2}
  out = pl.pallas_call(
      kernel,
      grid=(b, t, n_ranges, hk),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="sparse_attention_backward_dq",
  )(*args)
  if atomic_dkdv:
    dq, dk, dv = out
    return dq, dk[:, :, :tk], dv[:, :, :tk]
  return out[0]

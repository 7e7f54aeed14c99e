"""chunked_kda: Pallas chunked KDA (gated delta rule, per-channel decay) with a Pallas
backward (custom_vjp). Same contract as reference.kda_chunked."""
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.linear_attention import _kda_backward as bwd
from pallas_kernels.linear_attention import _kda_forward as fwd
from pallas_kernels.linear_attention._inputs import (
    CHUNK, default_scale, l2_normalize, pad_time, run_ids, validate)
from pallas_kernels.linear_attention._pallas_common import compute_dtype, interpret_mode


def _forward(q, k, v, b, beta, h0, runs, scale, bv, interpret, emit_output):
    cd = compute_dtype(q.dtype)
    w, u0, t = fwd.prepare(k, v, b, beta, runs, cd=cd, interpret=interpret)
    h, u, ht = fwd.states(k, b, runs, w, u0, h0, block_v=bv, interpret=interpret)
    if not emit_output:
        return w, t, h, u
    o = fwd.output(q, k, b, runs, h, u, scale=scale, out_dtype=v.dtype, block_v=bv, cd=cd,
                   interpret=interpret)
    return o, ht


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _kda_core(q, k, v, b, beta, h0, runs, scale, bv, interpret):
    return _forward(q, k, v, b, beta, h0, runs, scale, bv, interpret, True)


def _kda_core_fwd(q, k, v, b, beta, h0, runs, scale, bv, interpret):
    out = _kda_core(q, k, v, b, beta, h0, runs, scale, bv, interpret)
    return out, (q, k, v, b, beta, h0, runs)  # chunk inverses and states are recomputed


def _kda_core_bwd(scale, bv, interpret, res, cts):
    q, k, v, b, beta, h0, runs = res
    do, dht = cts
    do = do.astype(v.dtype)
    cd = compute_dtype(q.dtype)
    w, t, h, u = _forward(q, k, v, b, beta, h0, runs, scale, bv, interpret, False)
    dvl = bwd.local_dv(q, k, b, runs, do, scale=scale, block_v=bv, cd=cd, interpret=interpret)
    dh, du, dh0 = bwd.dstates(q, k, b, runs, w, dvl, do, dht, scale=scale, block_v=bv, cd=cd,
                              interpret=interpret)
    dq, dk, dv, db, dbeta = bwd.grads(q, k, v, b, beta, runs, h, dh, u, du, do, t, scale=scale,
                                      block_v=bv, cd=cd, interpret=interpret)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), db, dbeta, dh0, None)


_kda_core.defvjp(_kda_core_fwd, _kda_core_bwd)


def chunked_kda(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
                output_final_state=False, normalize_qk=True, block_v=None):
    """Chunked KDA on Pallas kernels (interpreted on CPU). q, k, g: [B, T, H, Dk]; v:
    [B, T, H, Dv]; beta: [B, T, H]; g is the per-channel log decay (<= 0). Returns
    (o [B, T, H, Dv] in v's dtype, fp32 final state [B, H, Dk, Dv] or None)."""
    B, T, H, Dk, Dv = validate(q, k, v, g, beta, initial_state, segment_ids)
    _check_head_dims(Dk, Dv)
    scale = default_scale(scale, Dk)
    if normalize_qk:  # plain JAX (autodiff) outside the kernels, back to the input dtype
        q, k = l2_normalize(q).astype(q.dtype), l2_normalize(k).astype(k.dtype)
    # pad with tokens that change nothing: k = v = 0, g = 0, beta = 0 (run ids repeat)
    Tp = -(-T // CHUNK) * CHUNK
    qp, kp, vp = (pad_time(x, Tp) for x in (q, k, v))
    g = pad_time(g.astype(jnp.float32), Tp)
    b = jnp.cumsum(g.reshape(B, Tp // CHUNK, CHUNK, H, Dk), axis=2).reshape(g.shape)
    beta = pad_time(beta.astype(jnp.float32), Tp)
    runs = pad_time(run_ids(segment_ids, B, T), Tp, "edge")
    h0 = (jnp.zeros((B, H, Dk, Dv), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    bv = block_v or min(Dv, 64)
    if bv < 16 or bv & (bv - 1) or Dv % bv:
        raise ValueError(f"block_v = {bv}: need a power of two >= 16 dividing Dv = {Dv}")
    o, ht = _kda_core(qp, kp, vp, b, beta, h0, runs, float(scale), bv, interpret_mode())
    return o[:, :T], (ht if output_final_state else None)


def _check_head_dims(Dk, Dv):
    for name, d in (("Dk (q.shape[-1])", Dk), ("Dv (v.shape[-1])", Dv)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"{name} = {d}: the Pallas kernels need a power of two >= 16")

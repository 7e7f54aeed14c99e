"""chunked_gla: Pallas chunked gated linear attention with a Pallas backward (custom_vjp)."""
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.linear_attention import _chunk_prep
from pallas_kernels.linear_attention._gla_kernels import gla_backward, gla_forward
from pallas_kernels.linear_attention._inputs import default_scale, validate
from pallas_kernels.linear_attention._pallas_common import interpret_mode


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _gla_core(q, k, v, b, h0, runs, scale, bv, interpret):
    return gla_forward(q, k, v, b, runs, h0, scale=scale, block_v=bv, emit_output=True,
                       interpret=interpret)


def _gla_core_fwd(q, k, v, b, h0, runs, scale, bv, interpret):
    out = _gla_core(q, k, v, b, h0, runs, scale, bv, interpret)
    return out, (q, k, v, b, h0, runs)  # per-chunk states are recomputed in the backward


def _gla_core_bwd(scale, bv, interpret, res, cts):
    q, k, v, b, h0, runs = res
    do, dht = cts
    h = gla_forward(q, k, v, b, runs, h0, scale=scale, block_v=bv, emit_output=False,
                    interpret=interpret)
    dq, dk, dv, db, dh0 = gla_backward(q, k, v, b, runs, h, do.astype(v.dtype), dht,
                                       scale=scale, block_v=bv, interpret=interpret)
    return (dq.sum(0).astype(q.dtype), dk.sum(0).astype(k.dtype), dv, db.sum(0), dh0, None)


_gla_core.defvjp(_gla_core_fwd, _gla_core_bwd)


def chunked_gla(q, k, v, g, *, scale=None, initial_state=None, segment_ids=None,
                output_final_state=False, block_v=None):
    """Chunked GLA on Pallas kernels; same contract as reference.gla_chunked."""
    B, T, H, Dk, Dv = validate(q, k, v, g, None, initial_state, segment_ids)
    _check_head_dims(Dk, Dv)
    scale = default_scale(scale, Dk)
    qp, kp, vp, b, runs = _chunk_prep.prepare(q, k, v, g, segment_ids, B, T)
    h0 = (jnp.zeros((B, H, Dk, Dv), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    bv = block_v or _chunk_prep.block_v(Dv)
    o, ht = _gla_core(qp, kp, vp, b, h0, runs, float(scale), bv, interpret_mode())
    return o[:, :T], (ht if output_final_state else None)


def _check_head_dims(Dk, Dv):
    for name, d in (("Dk (q.shape[-1])", Dk), ("Dv (v.shape[-1])", Dv)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"{name} = {d}: the Pallas kernels need a power of two >= 16")

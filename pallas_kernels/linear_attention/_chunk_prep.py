"""Plain-JAX preparation around the kernels: padding, in-chunk cumulative decay, run ids."""
import jax.numpy as jnp

from pallas_kernels.linear_attention._inputs import CHUNK, pad_time, run_ids


def padded_length(T):
    return -(-T // CHUNK) * CHUNK


def chunk_cumsum(g):
    """Cumulative log decay restarted at every chunk: [B, Tp, H, D] fp32 -> same shape."""
    B, Tp, H, D = g.shape
    return jnp.cumsum(g.astype(jnp.float32).reshape(B, Tp // CHUNK, CHUNK, H, D), axis=2).reshape(g.shape)


def prepare(q, k, v, g, segment_ids, B, T):
    """Pads to a multiple of the chunk (zero tokens: no contribution, no decay)."""
    Tp = padded_length(T)
    runs = pad_time(run_ids(segment_ids, B, T), Tp, "edge")
    q, k, v = (pad_time(x, Tp) for x in (q, k, v))
    b = chunk_cumsum(pad_time(g.astype(jnp.float32), Tp))
    return q, k, v, b, runs


def block_v(Dv):
    return min(Dv, 64)

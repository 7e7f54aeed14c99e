"""Preparation around the kernels: padding, in-chunk cumulative decay, segment masks,
per-chunk state factors and decayed rows."""
import jax.numpy as jnp

from pallas_kernels.linear_attention._chunk_cumsum import (chunk_cumsum, chunk_cumsum_and_layouts,
                                                           decay_cumsum)
from pallas_kernels.linear_attention._inputs import CHUNK, pad_time, run_ids


def padded_length(T):
  return -(-T // CHUNK) * CHUNK


def segment_masks(runs):
  """Per-token int32 flags from run ids [B, Tp]:
    carry_in: the token is in the run that was open before its chunk (it sees the chunk's
      start state; at the chunk's last token it says whether that state survives the chunk);
    in_last: the token is in the chunk's last run (its key/value reach the next chunk).
    """
  B, Tp = runs.shape
  per_chunk = runs.reshape(B, Tp // CHUNK, CHUNK)
  before = jnp.concatenate([jnp.zeros((B, 1), runs.dtype), per_chunk[:, :-1, -1]], axis=1)
  carry_in = per_chunk == before[:, :, None]
  in_last = per_chunk == per_chunk[:, :, -1:]
  return carry_in.reshape(B, Tp).astype(jnp.int32), in_last.reshape(B, Tp).astype(jnp.int32)


def prepare(q, k, v, g, segment_ids, B, T, decay=None, summed=True, layouts=False):
  """(q, k, v, b, runs): padded to a multiple of the chunk (zero tokens: no contribution,
    no decay), b the in-chunk cumulative log decay. With a decay_gate.DecayGate, g is the
    gate projection and the decay its function. summed=False: b is the padded log decays g
    themselves, for a kernel that sums them (without a decay gate only). layouts: each
    chunk's scores layout [B, H, n, C] follows (chunk_cumsum_and_layouts'; None with a decay
    gate, whose kernel sums part of a head's channels a program)."""
  Tp = padded_length(T)
  runs = pad_time(run_ids(segment_ids, B, T), Tp, "edge")
  q, k, v = (pad_time(x, Tp) for x in (q, k, v))
  if not summed:
    if decay is not None or layouts:
      raise ValueError("prepare(summed=False) takes the log decays g, not a decay gate's input, "
                       "and gives no layouts")
    return q, k, v, pad_time(g, Tp), runs
  if decay is not None:
    b = decay_cumsum(pad_time(g, Tp), decay, T)
    return (q, k, v, b, runs) + ((None,) if layouts else ())
  if layouts:
    b, chunk_layouts = chunk_cumsum_and_layouts(pad_time(g, Tp))
    return q, k, v, b, runs, chunk_layouts
  return q, k, v, chunk_cumsum(pad_time(g, Tp)), runs


def state_factors(b, carry_in):
  """keep exp(b_last) per chunk [B, NT, H, Dk] fp32: the factor that carries a state
    across each chunk (0 when a segment starts inside it)."""
  keep = carry_in[:, CHUNK - 1::CHUNK].astype(jnp.float32)
  return keep[:, :, None, None] * jnp.exp(b[:, CHUNK - 1::CHUNK])


def decayed_rows(q, k, b, carry_in, in_last, dtype):
  """(qg, kg) [B, Tp, H, Dk] in dtype: qg = q exp(b) carry_in, kg = k exp(b_last - b) in_last,
    the rows the fused GLA forward's products take (as _gla_scores writes them with
    decayed_with), here as one XLA fusion over q, k and b."""
  B, Tp, H, Dk = q.shape
  chunks = lambda x: x.reshape(B, Tp // CHUNK, CHUNK, *x.shape[2:])
  flag = lambda f: chunks(f).astype(jnp.float32)[..., None, None]
  bc = chunks(b)
  qg = chunks(q).astype(jnp.float32) * jnp.exp(bc) * flag(carry_in)
  kg = chunks(k).astype(jnp.float32) * jnp.exp(jnp.minimum(bc[:, :, -1:] - bc, 0.0)) * flag(in_last)
  return qg.astype(dtype).reshape(q.shape), kg.astype(dtype).reshape(k.shape)

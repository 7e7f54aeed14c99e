"""GLA over a long sequence walked as spans at once (chunked_gla's Tiling.spans).

The state walk is sequential over a sequence's chunks, one program per (row, head, value
block): a long sequence with few heads gives it few programs (8 heads of a 1M-token
sequence: 16 programs walking 16384 chunks each). Cut every sequence into `spans` equal
spans of whole chunks and the kernels take each span as a row of its own, from a zero
state: as many times the programs. GLA's decay is diagonal, so the state entering a span
joins after:
  S_t = D_t S_in + (the span's own state at t),  D_t = exp(g summed from the span's first
  token through t), per key channel,
for the tokens in the run the span starts with (the first reset in the span stops it),
and S_in of span p + 1 is span p's end state, D_last S_in + its own end state (without
the D_last S_in term where a reset falls inside span p; zero where span p + 1 starts a new
run). The spans' states go by a scan over spans (plain JAX, [H, Dk, Dv] per step); each
token's output gains scale (q_t D_t) S_in, one [L, Dk] x [Dk, Dv] product per span. The
kernels' custom VJPs and autodiff give the gradients (the spans' end states take the
cotangent of the states they hand on).
"""
import jax
import jax.numpy as jnp

from pallas_kernels.linear_attention._inputs import CHUNK, pad_time, run_ids


def span_length(T, spans):
  """Tokens per span: T cut into `spans` spans of whole chunks (the last padded)."""
  return -(-T // (spans * CHUNK)) * CHUNK


def in_spans(walk, q, k, v, g, *, spans, scale, initial_state, segment_ids):
  """(o [B, T, H, Dv] in v's dtype, final state [B, H, Dk, Dv] fp32) of GLA with the
    sequence walked as `spans` spans at once; walk(q, k, v, g, initial_state, segment_ids)
    -> (o, final state) is chunked_gla on rows of one span each."""
  B, T, H, Dk = q.shape
  Dv = v.shape[-1]
  L = span_length(T, spans)
  # padding that changes nothing: k = v = 0, g = 0, the last token's run
  padded = [pad_time(x, spans * L) for x in (q, k, v, g)]
  runs = pad_time(run_ids(segment_ids, B, T), spans * L, "edge")
  as_spans = lambda x: x.reshape(B * spans, L, *x.shape[2:])
  o_own, end_own = walk(*map(as_spans, padded), None, as_spans(runs))

  runs = runs.reshape(B, spans, L)
  # tokens in the run their span starts with: the state entering the span reaches them
  first_run = (runs == runs[:, :, :1])[..., None, None]  # [B, spans, L, 1, 1]
  # the state leaving span p - 1 enters span p where span p's first token continues its run
  continues = jnp.concatenate([jnp.ones((B, 1), bool), runs[:, 1:, 0] == runs[:, :-1, -1]],
                              axis=1)  # [B, spans]
  decays = jnp.cumsum(padded[3].astype(jnp.float32).reshape(B, spans, L, H, Dk), axis=2)
  keeps = (runs[:, :, -1] == runs[:, :, 0])[..., None, None, None]  # no reset in the span
  span_decay = jnp.where(keeps, jnp.exp(decays[:, :, -1])[..., None], 0.0)  # [B, spans, H, Dk, 1]
  end_own = end_own.reshape(B, spans, H, Dk, Dv)

  def step(state, span):
    cont, decay, own = span
    entering = jnp.where(cont[:, None, None, None], state, 0.0)
    return decay * entering + own, entering

  h0 = jnp.zeros((B, H, Dk, Dv), jnp.float32) if initial_state is None else initial_state
  final, entering = jax.lax.scan(step, h0.astype(
      jnp.float32), (continues.T, jnp.moveaxis(span_decay, 1, 0), jnp.moveaxis(end_own, 1, 0)))
  entering = jnp.moveaxis(entering, 0, 1)  # [B, spans, H, Dk, Dv]

  queries = jnp.where(first_run, padded[0].reshape(B, spans, L, H, Dk) * jnp.exp(decays), 0.0)
  cd = q.dtype if jnp.dtype(q.dtype).itemsize < 4 else jnp.float32
  carried = jnp.einsum("bpthk,bphkv->bpthv", queries.astype(cd), entering.astype(cd),
                       preferred_element_type=jnp.float32,
                       precision=jax.lax.Precision.HIGHEST if cd == jnp.float32 else None)
  o = o_own.reshape(B, spans, L, H, Dv).astype(jnp.float32) + scale * carried
  return o.reshape(B, spans * L, H, Dv)[:, :T].astype(v.dtype), final

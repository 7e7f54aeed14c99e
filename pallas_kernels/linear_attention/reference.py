"""Plain-JAX gated linear attention (GLA) and gated delta rule (KDA).

Per batch row and head, with S the [Dk, Dv] fp32 state (zero at the start unless
initial_state is given, reset to zero before the first token of each new segment):
  GLA  S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T
  KDA  S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
  o_t = scale * S_t^T q_t
`*_recurrent` is the token-by-token oracle; `*_chunked` is the memory-sane chunked form
(chunk 64, no [T, T] tensors, differentiable by plain autodiff) used as the CPU default.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.linear_attention._inputs import (CHUNK, default_scale, l2_normalize, pad_time,
                                                     run_ids, validate)

_HI = jax.lax.Precision.HIGHEST
SUB = 16  # sub-chunk of the decay factorisation in _pair_decay_scores


def _time_major(x):
  return jnp.moveaxis(x, 1, 0)


def _initial(initial_state, B, H, Dk, Dv):
  if initial_state is None:
    return jnp.zeros((B, H, Dk, Dv), jnp.float32)
  return initial_state.astype(jnp.float32)


def _recurrent(q, k, v, g, beta, scale, initial_state, segment_ids, output_final_state):
  B, T, H, Dk, Dv = validate(q, k, v, g, beta, initial_state, segment_ids)
  scale = default_scale(scale, Dk)
  runs = run_ids(segment_ids, B, T)
  reset = jnp.concatenate([jnp.zeros((B, 1), bool), runs[:, 1:] != runs[:, :-1]], axis=1)
  f32 = lambda x: _time_major(x.astype(jnp.float32))
  xs = (f32(q), f32(k), f32(v), f32(g), _time_major(reset))
  xs += (f32(beta),) if beta is not None else (jnp.zeros((T, 0)),)

  def step(S, x):
    qt, kt, vt, gt, rt, bt = x
    S = jnp.where(rt[:, None, None, None], 0.0, S) * jnp.exp(gt)[..., None]
    if beta is None:
      S = S + kt[..., :, None] * vt[..., None, :]
    else:
      pred = jnp.einsum("bhk,bhkv->bhv", kt, S, precision=_HI)
      S = S + (bt[..., None] * kt)[..., :, None] * (vt - pred)[..., None, :]
    return S, scale * jnp.einsum("bhk,bhkv->bhv", qt, S, precision=_HI)

  S, o = jax.lax.scan(step, _initial(initial_state, B, H, Dk, Dv), xs)
  return _time_major(o).astype(v.dtype), (S if output_final_state else None)


def gla_recurrent(q, k, v, g, *, scale=None, initial_state=None, segment_ids=None,
                  output_final_state=False):
  """Token-by-token GLA oracle (fp32 math). Returns (o, final_state or None)."""
  return _recurrent(q, k, v, g, None, scale, initial_state, segment_ids, output_final_state)


def kda_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
                  output_final_state=False, normalize_qk=True, decay=None):
  """Token-by-token KDA (gated delta rule, per-channel decay) oracle; with decay (a
    decay_gate.DecayGate), g is the gate projection and the log decay decay(g)."""
  validate(q, k, v, g, beta, initial_state, segment_ids, decay)
  if decay is not None:
    g = decay(g)
  if normalize_qk:
    q, k = l2_normalize(q), l2_normalize(k)
  return _recurrent(q, k, v, g, beta, scale, initial_state, segment_ids, output_final_state)


def _chunk_decays(g, runs, prev_run):
  """Cumulative in-chunk log decay and the segment masks of one chunk.

    g: [B, H, C, Dk]; runs: [B, C]; prev_run: [B] run index of the token before the chunk.
    """
  b = jnp.cumsum(g, axis=2)
  same = (runs[:, :, None] == runs[:, None, :])[:, None]  # [B, 1, C, C]
  carry_in = (runs == prev_run[:, None])[:, None, :, None]  # token still sees S_0
  in_last = (runs == runs[:, -1:])[:, None, :, None]  # token reaches S_C
  keep_old = (runs[:, -1] == prev_run)[:, None, None, None]  # S_0 survives the chunk
  return b, same, carry_in, in_last, keep_old


def _pair_decay_scores(x, k, b, same, strict):
  """sum_d x_t[d] k_s[d] exp(b_t[d] - b_s[d]) for s < t (s <= t unless strict) in the same
    run (same: [.., C, C]), else 0. x, k, b: [.., C, D].

    No [.., C, C, D] tensor: keys in an earlier 16-token sub-chunk take the decay split at
    the end of the sub-chunk before the query's, (x_t exp(b_t - b_ref)) . (k_s exp(b_ref - b_s)),
    a plain matmul whose factors are both exp(<= 0); pairs inside a 16x16 diagonal block
    form each exp(b_t - b_s) exactly ([.., C/16, 16, 16, D], 4x smaller). Exponents outside
    the pair structure are masked to -inf before exp, so with g <= 0 only exp(<= 0) is taken.
    """
  *lead, C, D = x.shape
  n = C // SUB
  xs, ks, bs = (a.reshape(*lead, n, SUB, D) for a in (x, k, b))
  # sub-chunks 1..n-1 against every key before their start
  b_ref = bs[..., :-1, -1, :]  # [.., n-1, D]
  q_fac = xs[..., 1:, :, :] * jnp.exp(bs[..., 1:, :, :] - b_ref[..., :, None, :])
  earlier = jnp.arange(C)[None, :] < SUB * jnp.arange(1, n)[:, None]  # [n-1, C]
  k_exp = jnp.where(earlier[:, :, None], b_ref[..., :, None, :] - b[..., None, :, :], -jnp.inf)
  off = jnp.einsum("...itd,...isd->...its", q_fac, k[..., None, :, :] * jnp.exp(k_exp),
                   precision=_HI)  # [.., n-1, SUB, C]
  off = jnp.concatenate([jnp.zeros_like(off[..., :1, :, :]), off], axis=-3).reshape(*lead, C, C)
  # exact 16x16 diagonal blocks
  tri = jnp.tril(jnp.ones((SUB, SUB), bool), -1 if strict else 0)
  diff = bs[..., :, :, None, :] - bs[..., :, None, :, :]  # [.., n, SUB, SUB, D]
  decay = jnp.exp(jnp.where(tri[:, :, None], diff, -jnp.inf))
  diag = jnp.einsum("...itd,...isd,...itsd->...its", xs, ks, decay, precision=_HI)
  diag = jnp.einsum("...its,ij->...itjs", diag, jnp.eye(n, dtype=diag.dtype)).reshape(*lead, C, C)
  return jnp.where(same, off + diag, 0.0)


def _unit_lower_solve(strict_lower, rhs):
  """(I + L)^-1 rhs for strictly lower-triangular L [..., C, C] by a triangular solve.

    Stable for any keys: a power series in L (e.g. repeated squaring) builds intermediates
    that grow combinatorially when nearby keys are nearly parallel and returns garbage in
    fp32, although the inverse itself stays moderate."""
  return jax.lax.linalg.triangular_solve(strict_lower, rhs, left_side=True, lower=True,
                                         unit_diagonal=True)


def _chunked(q, k, v, g, beta, scale, initial_state, segment_ids, output_final_state,
             normalize_qk=False):
  B, T, H, Dk, Dv = validate(q, k, v, g, beta, initial_state, segment_ids)
  scale = default_scale(scale, Dk)
  C = CHUNK
  n = -(-T // C)
  t_pad = n * C
  runs = pad_time(run_ids(segment_ids, B, T), t_pad, "edge")

  def chunks(x):  # [B, T, H, ...] -> [N, B, C, H, ...], input dtype (a cheap reshape)
    x = pad_time(x, t_pad)
    return jnp.moveaxis(x.reshape(B, n, C, *x.shape[2:]), 1, 0)

  xs = (chunks(q), chunks(k), chunks(v), chunks(g), jnp.moveaxis(runs.reshape(B, n, C), 1, 0))
  xs += (chunks(beta),) if beta is not None else (jnp.zeros((n, 0)),)

  @jax.checkpoint  # keep autodiff residuals at one state per chunk
  def step(carry, x):
    S, prev_run = carry
    rc = x[4]
    # fp32 [B, H, C, D] only inside the step: no full-length fp32 copies of the inputs
    qc, kc, vc, gc = (jnp.moveaxis(a.astype(jnp.float32), 2, 1) for a in x[:4])
    bc = jnp.moveaxis(x[5].astype(jnp.float32), 2, 1) if beta is not None else None
    if normalize_qk:
      qc, kc = l2_normalize(qc), l2_normalize(kc)
    b, same, carry_in, in_last, keep_old = _chunk_decays(gc, rc, prev_run)
    q_dec = qc * jnp.exp(b) * carry_in
    if beta is None:
      u = vc
    else:
      akk = _pair_decay_scores(kc, kc, b, same, strict=True)
      rhs = bc[..., None] * (vc - jnp.einsum("bhck,bhkv->bhcv",
                                             kc * jnp.exp(b) * carry_in, S, precision=_HI))
      u = _unit_lower_solve(bc[..., None] * akk, rhs)
    aqk = _pair_decay_scores(qc, kc, b, same, strict=False)
    o = scale * (jnp.einsum("bhck,bhkv->bhcv", q_dec, S, precision=_HI) +
                 jnp.einsum("bhts,bhsv->bhtv", aqk, u, precision=_HI))
    b_last = b[:, :, -1:, :]
    k_dec = kc * jnp.exp(b_last - b) * in_last
    S = (jnp.where(keep_old,
                   jnp.exp(b_last[:, :, 0, :, None]) * S, 0.0) +
         jnp.einsum("bhck,bhcv->bhkv", k_dec, u, precision=_HI))
    return (S, rc[:, -1]), jnp.moveaxis(o, 1, 2).astype(v.dtype)

  init = (_initial(initial_state, B, H, Dk, Dv), jnp.zeros((B,), jnp.int32))
  (S, _), o = jax.lax.scan(step, init, xs)
  o = jnp.moveaxis(o, 0, 1).reshape(B, t_pad, H, Dv)[:, :T]
  return o, (S if output_final_state else None)


def gla_chunked(q, k, v, g, *, scale=None, initial_state=None, segment_ids=None,
                output_final_state=False):
  """Chunked GLA in plain JAX (chunk 64, fp32 state carried across chunks by lax.scan)."""
  return _chunked(q, k, v, g, None, scale, initial_state, segment_ids, output_final_state)


def kda_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
                output_final_state=False, normalize_qk=True, decay=None):
  """Chunked KDA in plain JAX: per-chunk UT transform (unit lower-triangular solve).

    q and k are L2-normalised chunk by chunk inside the scan, so no full-length fp32 copy
    of them (or of their gradients) is kept. With decay (a decay_gate.DecayGate), g is the
    gate projection and the log decay decay(g)."""
  validate(q, k, v, g, beta, initial_state, segment_ids, decay)
  if decay is not None:
    g = decay(g)
  return _chunked(q, k, v, g, beta, scale, initial_state, segment_ids, output_final_state,
                  normalize_qk)

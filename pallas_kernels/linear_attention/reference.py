"""Plain-JAX gated linear attention (GLA) and gated delta rule (KDA).

Per batch row and head, with S the [Dk, Dv] fp32 state (zero at the start unless
initial_state is given, reset to zero before the first token of each new segment):
  GLA  S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T
  KDA  S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
  o_t = scale * S_t^T q_t
`*_recurrent` is the token-by-token oracle; `*_chunked` is the memory-sane chunked form
(chunk 64, no [T, T] tensors, differentiable by plain autodiff) used as the CPU default.
"""
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.linear_attention._inputs import (
    CHUNK, default_scale, l2_normalize, pad_time, run_ids, validate)

_HI = jax.lax.Precision.HIGHEST


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
                  output_final_state=False, normalize_qk=True):
    """Token-by-token KDA (gated delta rule, per-channel decay) oracle."""
    validate(q, k, v, g, beta, initial_state, segment_ids)
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    return _recurrent(q, k, v, g, beta, scale, initial_state, segment_ids, output_final_state)


def _chunk_decays(g, runs, prev_run):
    """Cumulative in-chunk log decay and the segment masks of one chunk.

    g: [B, H, C, Dk]; runs: [B, C]; prev_run: [B] run index of the token before the chunk.
    """
    C = g.shape[2]
    b = jnp.cumsum(g, axis=2)
    causal = jnp.tril(jnp.ones((C, C), bool))
    same = (runs[:, :, None] == runs[:, None, :])[:, None]           # [B, 1, C, C]
    carry_in = (runs == prev_run[:, None])[:, None, :, None]           # token still sees S_0
    in_last = (runs == runs[:, -1:])[:, None, :, None]                 # token reaches S_C
    keep_old = (runs[:, -1] == prev_run)[:, None, None, None]          # S_0 survives the chunk
    return b, causal, same, carry_in, in_last, keep_old


def _pair_decay_scores(x, k, b, mask):
    """sum_d x_t[d] k_s[d] exp(b_t[d] - b_s[d]) for the (t, s) pairs in mask, else 0.

    The exponent is masked to -inf before exp, so only b_t - b_s <= 0 is ever exponentiated.
    """
    diff = b[:, :, :, None, :] - b[:, :, None, :, :]
    decay = jnp.exp(jnp.where(mask[..., None], diff, -jnp.inf))
    return jnp.einsum("bhtd,bhsd,bhtsd->bhts", x, k, decay, precision=_HI)


def _unit_lower_inverse(a):
    """Inverse of a unit lower-triangular [..., C, C] matrix I + L by repeated squaring:
    (I + L)^-1 = (I - L)(I + L^2)(I + L^4)...; L is nilpotent (L^C = 0), so log2(C)
    batched matmuls give the exact inverse. Unlike a triangular solve this stays a few
    dense matmuls, which partition and vectorise well on every backend."""
    c = a.shape[-1]
    eye = jnp.eye(c, dtype=a.dtype)
    low = a - eye
    inv = eye - low
    power = low
    for _ in range(max(1, (c - 1).bit_length()) - 1):
        power = jnp.matmul(power, power, precision=_HI)
        inv = jnp.matmul(inv, eye + power, precision=_HI)
    return inv


def _chunked(q, k, v, g, beta, scale, initial_state, segment_ids, output_final_state):
    B, T, H, Dk, Dv = validate(q, k, v, g, beta, initial_state, segment_ids)
    scale = default_scale(scale, Dk)
    C = CHUNK
    n = -(-T // C)
    t_pad = n * C
    runs = pad_time(run_ids(segment_ids, B, T), t_pad, "edge")

    def chunks(x):  # [B, T, H, D] -> [N, B, H, C, D]
        x = pad_time(x.astype(jnp.float32), t_pad)
        return jnp.moveaxis(x.reshape(B, n, C, H, -1), (1, 3), (0, 2))

    xs = (chunks(q), chunks(k), chunks(v), chunks(g),
          jnp.moveaxis(runs.reshape(B, n, C), 1, 0))
    xs += (chunks(beta[..., None])[..., 0],) if beta is not None else (jnp.zeros((n, 0)),)

    @jax.checkpoint  # keep autodiff residuals at one state per chunk
    def step(carry, x):
        S, prev_run = carry
        qc, kc, vc, gc, rc, bc = x
        b, causal, same, carry_in, in_last, keep_old = _chunk_decays(gc, rc, prev_run)
        q_dec = qc * jnp.exp(b) * carry_in
        if beta is None:
            u = vc
        else:
            strict = same & jnp.tril(jnp.ones((C, C), bool), -1)
            akk = _pair_decay_scores(kc, kc, b, strict)
            lower = jnp.eye(C) + bc[..., None] * akk
            rhs = bc[..., None] * (vc - jnp.einsum("bhck,bhkv->bhcv", kc * jnp.exp(b) * carry_in,
                                                   S, precision=_HI))
            u = jnp.einsum("bhts,bhsv->bhtv", _unit_lower_inverse(lower), rhs, precision=_HI)
        aqk = _pair_decay_scores(qc, kc, b, same & causal)
        o = scale * (jnp.einsum("bhck,bhkv->bhcv", q_dec, S, precision=_HI)
                     + jnp.einsum("bhts,bhsv->bhtv", aqk, u, precision=_HI))
        b_last = b[:, :, -1:, :]
        k_dec = kc * jnp.exp(b_last - b) * in_last
        S = (jnp.where(keep_old, jnp.exp(b_last[:, :, 0, :, None]) * S, 0.0)
             + jnp.einsum("bhck,bhcv->bhkv", k_dec, u, precision=_HI))
        return (S, rc[:, -1]), o

    init = (_initial(initial_state, B, H, Dk, Dv), jnp.zeros((B,), jnp.int32))
    (S, _), o = jax.lax.scan(step, init, xs)
    o = jnp.moveaxis(o, (0, 2), (1, 3)).reshape(B, t_pad, H, Dv)[:, :T]
    return o.astype(v.dtype), (S if output_final_state else None)


def gla_chunked(q, k, v, g, *, scale=None, initial_state=None, segment_ids=None,
                output_final_state=False):
    """Chunked GLA in plain JAX (chunk 64, fp32 state carried across chunks by lax.scan)."""
    return _chunked(q, k, v, g, None, scale, initial_state, segment_ids, output_final_state)


def kda_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
                output_final_state=False, normalize_qk=True):
    """Chunked KDA in plain JAX: per-chunk UT transform (unit lower-triangular solve)."""
    validate(q, k, v, g, beta, initial_state, segment_ids)
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    return _chunked(q, k, v, g, beta, scale, initial_state, segment_ids, output_final_state)

"""The short convolution + SiLU (+ L2 norm) with each program streaming the rows of one head:
short_conv_silu's "rows" form.

One program per (row, block of tokens, head) walks its block one token at a time, the
head's channels across one warp, keeping the K - 1 earlier inputs in registers: each input
is read once (and the K - 1 before the block) and each output written once, with no shift
products and no halo blocks. Each step loads the rows of the next UNROLL tokens before it
computes the current ones, so that several loads are in flight per program.

The backward walks the same way, K - 1 tokens ahead: at token t it recomputes the
convolution from the inputs it holds, takes the norm's and SiLU's derivatives to dy[t],
adds t's pairs to the block's partial of the weight's gradient (each pair counted at its
later token, where the block owns it), and forms dx[t - K + 1] from dy at t - K + 1 .. t.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.short_conv._activation import F32, activate, pre_activation_grad

UNROLL = 4  # tokens whose rows each step loads ahead
# the backward's: it holds three rows a token (x, dout, dy) where the forward holds one
BACKWARD_UNROLL = 2
NUM_WARPS = 1  # one head's channels across one warp
BLOCK_TOKENS = (64, 32, 16)  # a program's tokens: the largest dividing the length
_sq = pl.squeezed


def block_tokens(length: int) -> int:
  return next(bt for bt in BLOCK_TOKENS if length % bt == 0)


def _row(ref, t):
  """Token t's row of a [T, D] ref, fp32 [1, D]; zeros past either end."""
  length = ref.shape[0]
  row = ref[pl.ds(jnp.clip(t, 0, length - 1), 1), :].astype(F32)
  return jnp.where((t >= 0) & (t < length), row, 0.0)


def _reach(ref, t):
  """Token t's reach [1, 1] (reference.token_reach); -1 past the end: no tap."""
  length = ref.shape[0]
  return jnp.where(t < length, ref[pl.ds(jnp.minimum(t, length - 1), 1)], -1)[:, None]


def _taps(w_ref, taps):
  return [w_ref[pl.ds(j, 1), :] for j in range(taps)]


def _conv(x_t, earlier, reach, w):
  """The convolution at a token from its input and the K - 1 before it (earlier, latest
    first), tap s kept where the token's reach covers it."""
  taps = len(w)
  y = x_t * w[taps - 1]
  for s, past in enumerate(earlier, start=1):
    y = y + jnp.where(reach >= s, past, 0.0) * w[taps - 1 - s]
  return y


def _before(x_ref, t0, taps):
  """The K - 1 inputs before token t0, latest first."""
  return tuple(_row(x_ref, t0 - s) for s in range(1, taps))


def _forward_kernel(x_ref, reach_ref, w_ref, out_ref, *, taps, normalize, bt):
  t0 = pl.program_id(1) * bt
  w = _taps(w_ref, taps)

  def step(j, carry):
    earlier, rows = carry
    i = j * UNROLL
    ahead = tuple(_row(x_ref, t0 + i + UNROLL + u) for u in range(UNROLL))
    for u, x_t in enumerate(rows):
      y = _conv(x_t, earlier, _reach(reach_ref, t0 + i + u), w)
      out_ref[pl.ds(i + u, 1), :] = activate(y, out_ref.dtype, normalize)[0].astype(out_ref.dtype)
      earlier = ((x_t,) + earlier)[:taps - 1]
    return earlier, ahead

  first = tuple(_row(x_ref, t0 + u) for u in range(UNROLL))
  jax.lax.fori_loop(0, bt // UNROLL, step, (_before(x_ref, t0, taps), first))


def _backward_kernel(x_ref, reach_ref, w_ref, dout_ref, dx_ref, dw_ref, *, taps, normalize, bt):
  """dx of the block and its partial of dw ([Kp, D]: row K-1-s sums dy[t] x[t - s] over the
    block's tokens t)."""
  t0 = pl.program_id(1) * bt
  w = _taps(w_ref, taps)
  lead = taps - 1  # dy runs this many tokens ahead of dx
  dtype = dx_ref.dtype

  def inputs(t):
    return _row(x_ref, t), _reach(reach_ref, t), _row(dout_ref, t)

  def grad_at(t, x_t, reach, dout, earlier, dw):
    """dy[t] (0 past the end: dout is), and dw with t's pairs where the block owns t."""
    dy = pre_activation_grad(_conv(x_t, earlier, reach, w), dout, dtype, normalize)
    own = (t >= t0) & (t < t0 + bt)
    pairs = (x_t,) + tuple(jnp.where(reach >= s, past, 0.0) for s, past in enumerate(earlier, 1))
    dw = tuple(d + jnp.where(own, dy * pairs[taps - 1 - k], 0.0) if k < taps else d
               for k, d in enumerate(dw))
    return dy, dw

  # before the walk: dy at the block's first K - 1 tokens
  earlier = _before(x_ref, t0, taps)
  dw = tuple(jnp.zeros((1, dw_ref.shape[-1]), F32) for _ in range(dw_ref.shape[0]))
  pending = ()  # dy at the K - 1 tokens before the step's, earliest first
  for u in range(lead):
    x_t, reach, dout = inputs(t0 + u)
    dy, dw = grad_at(t0 + u, x_t, reach, dout, earlier, dw)
    pending += (dy,)
    earlier = ((x_t,) + earlier)[:taps - 1]

  def step(j, carry):
    earlier, pending, dw, rows = carry
    i = j * BACKWARD_UNROLL
    ahead = tuple(inputs(t0 + lead + i + BACKWARD_UNROLL + u) for u in range(BACKWARD_UNROLL))
    for u, (x_t, reach, dout) in enumerate(rows):
      t = t0 + lead + i + u
      dy, dw = grad_at(t, x_t, reach, dout, earlier, dw)
      earlier = ((x_t,) + earlier)[:taps - 1]
      window = pending + (dy,)  # dy at t - K + 1 .. t: what dx[t - K + 1] takes
      dx = window[0] * w[taps - 1]
      for s in range(1, taps):
        later = _reach(reach_ref, t - lead + s)
        dx = dx + jnp.where(later >= s, window[s], 0.0) * w[taps - 1 - s]
      dx_ref[pl.ds(i + u, 1), :] = dx.astype(dtype)
      pending = window[1:]
    return earlier, pending, dw, ahead

  first = tuple(inputs(t0 + lead + u) for u in range(BACKWARD_UNROLL))
  _, _, dw, _ = jax.lax.fori_loop(0, bt // BACKWARD_UNROLL, step, (earlier, pending, dw, first))
  for k, row in enumerate(dw):
    dw_ref[pl.ds(k, 1), :] = row


def _call(kernel, name, x, bt, in_specs, out_specs, out_shape, interpret):
  B, T, H, _ = x.shape
  return pl.pallas_call(kernel, grid=(B, T // bt, H), in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape,
                        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
                        interpret=interpret, name=name)


def _specs(T, D, kp, bt):
  """(the whole sequence of one row and head, a block of it, the whole row's reach, the
    head's taps)."""
  return (pl.BlockSpec((_sq, T, _sq, D), lambda b, c, h:
                       (b, 0, h, 0)), pl.BlockSpec((_sq, bt, _sq, D), lambda b, c, h: (b, c, h, 0)),
          pl.BlockSpec((_sq, T), lambda b, c, h:
                       (b, 0)), pl.BlockSpec((_sq, kp, D), lambda b, c, h: (h, 0, 0)))


def forward(x, w_taps, reach, taps, normalize, interpret):
  """short_conv_silu's output by rows (w_taps [H, Kp, D] fp32, reach [B, T] int32)."""
  B, T, H, D = x.shape
  bt = block_tokens(T)
  sequence, block, reach_spec, weights = _specs(T, D, w_taps.shape[1], bt)
  kernel = functools.partial(_forward_kernel, taps=taps, normalize=normalize, bt=bt)
  return _call(kernel, "short_conv_silu_rows", x, bt, [sequence, reach_spec, weights], block,
               jax.ShapeDtypeStruct(x.shape, x.dtype), interpret)(x, reach, w_taps)


def backward(x, w_taps, reach, dout, taps, normalize, interpret):
  """(dx [B, T, H, D] in x's dtype, dw [H, Kp, D] fp32) by rows."""
  B, T, H, D = x.shape
  bt = block_tokens(T)
  kp = w_taps.shape[1]
  sequence, block, reach_spec, weights = _specs(T, D, kp, bt)
  partial = pl.BlockSpec((_sq, _sq, _sq, kp, D), lambda b, c, h: (b, c, h, 0, 0))
  kernel = functools.partial(_backward_kernel, taps=taps, normalize=normalize, bt=bt)
  grads = [
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      jax.ShapeDtypeStruct((B, T // bt, H, kp, D), F32)
  ]
  dx, dw = _call(kernel, "short_conv_silu_rows_bwd", x, bt,
                 [sequence, reach_spec, weights, sequence], [block, partial], grads,
                 interpret)(x, reach, w_taps, dout)
  return dx, jnp.sum(dw, axis=(0, 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def by_rows(x, w_taps, reach, taps, normalize, interpret):
  """short_conv_silu's "rows" form, forward and backward."""
  return forward(x, w_taps, reach, taps, normalize, interpret)


def _by_rows_fwd(x, w_taps, reach, taps, normalize, interpret):
  return forward(x, w_taps, reach, taps, normalize, interpret), (x, w_taps, reach)


def _by_rows_bwd(taps, normalize, interpret, residuals, dout):
  x, w_taps, reach = residuals
  dx, dw = backward(x, w_taps, reach, dout, taps, normalize, interpret)
  return dx, dw, None


by_rows.defvjp(_by_rows_fwd, _by_rows_bwd)

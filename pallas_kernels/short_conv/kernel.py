"""The short causal depthwise convolution, SiLU and (optionally) the per-head L2 norm as one
Pallas pass forward and one or two backward: x is read once and the result written once,
where XLA writes the convolution's output and reads it back for the norm.

One program per (row, block of tokens, head) holds a [BT, D] block. The shift of the
block by s tokens is a product with a 0/1 matrix on the matrix units, its entry for
(token t, token t - s) zeroed where t - s lies in another document: the K - 1 earlier
tokens of the block's first rows come from a 16-token halo (the preceding 16 tokens),
the backward's later ones (the transposed shift) from the following 16. Each token's
reach, how many earlier tokens of its own document the taps may read (at most K - 1),
is counted once in XLA from the segment ids. fp32 operands of the shifts split into two
bf16 halves (the shift moves values, so the result is exact to 2^-16).

The backward recomputes the forward from x, takes the norm's and SiLU's derivatives in
fp32 to dy (the gradient of the convolution's output), and writes dx and a per-block
partial of the weight's gradient that XLA sums. It comes in two forms (`backward=`):
"one_kernel" does it all in one program per block, recomputing dy for the block and for
the following 16 tokens (whose taps reach back into it); "two_kernels" splits it into
lighter programs: the first writes dy as its two bf16 halves (fp32's bytes), the second
reads them for the block and the following 16 tokens and shifts them for dx and dw
(no halo of x: each pair of dw counts in its earlier token's block).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.short_conv.rows import by_rows
from pallas_kernels.short_conv._activation import activate, pre_activation_grad
from pallas_kernels.short_conv.reference import short_conv_silu_reference, token_reach

F32 = jnp.float32
HALO = 16  # tokens next to a block that a shift may read: the smallest matmul side
NUM_WARPS = 8  # every kernel here: at 4 each program holds more registers
BACKWARDS = ("one_kernel", "two_kernels")
FORMS = ("blocks", "rows")
BLOCK_TOKENS = (32, HALO)  # the forward's: the largest dividing the length
# The two-kernel backward at 16-token blocks: the fastest backward timed
# (docs/kernel_tuning.md, "Blocks and backward form")
BACKWARD_BLOCK_TOKENS = HALO
_sq = pl.squeezed


def _shift(rows: int, cols: int, s: int, offset: int, reach, along_rows: bool):
  """The 0/1 matrix that moves token (i - s) to token i: entry [i, j] is 1 where token i
    (row i, or column i if not along_rows) is s tokens after token j + offset and its
    reach covers s. reach: [rows, 1] (along rows) or [1, cols]."""
  r = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 0)
  c = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
  later, earlier = (r, c) if along_rows else (c, r)
  return (later + offset - earlier == s) & (reach >= s)


def _apply(matrix, x_hi, x_lo):
  """matrix (bool) @ x, x given as bf16 halves (x_lo None: x is x_hi exactly)."""
  m = jnp.where(matrix, 1.0, 0.0).astype(x_hi.dtype)
  out = jnp.dot(m, x_hi, preferred_element_type=F32)
  if x_lo is not None:
    out = out + jnp.dot(m, x_lo, preferred_element_type=F32)
  return out


def _halves(x):
  """x as matmul operands: bf16 / f16 as is; fp32 as a bf16 high and low half."""
  if x.dtype in (jnp.bfloat16, jnp.float16):
    return x, None
  x = x.astype(F32)
  hi = x.astype(jnp.bfloat16)
  return hi, (x - hi.astype(F32)).astype(jnp.bfloat16)


def _tap(w_ref, k):
  """Tap k of the block's weights, [1, D] fp32."""
  return w_ref[pl.ds(k, 1), :]


def _past(x, halo, reach, s):
  """Each token's input s tokens earlier where its document reaches that far, else 0
    (fp32 [BT, D])."""
  if s == 0:
    return x.astype(F32)
  bt = x.shape[0]
  return (_apply(_shift(bt, bt, s, 0, reach[:, None], True), *_halves(x)) +
          _apply(_shift(bt, HALO, s, HALO, reach[:, None], True), *_halves(halo)))


def _conv(x, halo, reach, w_ref, taps):
  """The block's convolution output, fp32 [BT, D]."""
  y = _past(x, halo, reach, 0) * _tap(w_ref, taps - 1)
  for s in range(1, taps):
    y = y + _past(x, halo, reach, s) * _tap(w_ref, taps - 1 - s)
  return y


def _forward_kernel(x_ref, halo_ref, reach_ref, w_ref, out_ref, *, taps, normalize):
  y = _conv(x_ref[...], halo_ref[...], reach_ref[...], w_ref, taps)
  out_ref[...] = activate(y, out_ref.dtype, normalize)[0].astype(out_ref.dtype)


def _backward_kernel(x_ref, halo_ref, next_ref, reach_ref, reach_next_ref, w_ref, dout_ref,
                     dout_next_ref, dx_ref, dw_ref, *, taps, normalize, blocks):
  x, halo, reach = x_ref[...], halo_ref[...], reach_ref[...]
  dtype = dx_ref.dtype
  bt = x.shape[0]
  y = _conv(x, halo, reach, w_ref, taps)
  dy = pre_activation_grad(y, dout_ref[...].astype(F32), dtype, normalize)
  # The next 16 tokens' convolution gradient: their taps reach back into this block.
  x_next, reach_next = next_ref[...], reach_next_ref[...]
  y_next = _conv(x_next, x_ref[pl.ds(bt - HALO, HALO), :], reach_next, w_ref, taps)
  has_next = pl.program_id(1) < blocks - 1
  dy_next = jnp.where(has_next,
                      pre_activation_grad(y_next, dout_next_ref[...].astype(F32), dtype, normalize),
                      0.0)
  dx = dy * _tap(w_ref, taps - 1)
  rows = jax.lax.broadcasted_iota(jnp.int32, (dw_ref.shape[0], 1), 0)
  dw = jnp.where(rows == taps - 1, jnp.sum(dy * x.astype(F32), axis=0)[None, :], 0.0)
  for s in range(1, taps):
    tap = _tap(w_ref, taps - 1 - s)
    dx = dx + _apply(_shift(bt, bt, s, 0, reach[None, :], False), *_halves(dy * tap))
    dx = dx + _apply(_shift(bt, HALO, s, bt, reach_next[None, :], False), *_halves(dy_next * tap))
    # the shifted input again rather than held from the forward's recomputation: registers
    past = jnp.sum(dy * _past(x, halo, reach, s), axis=0)
    dw = dw + jnp.where(rows == taps - 1 - s, past[None, :], 0.0)
  dx_ref[...] = dx.astype(dtype)
  dw_ref[...] = dw


def _dy_kernel(x_ref, halo_ref, reach_ref, w_ref, dout_ref, dy_hi_ref, dy_lo_ref, *, taps,
               normalize):
  """The two-kernel backward's first half: dy, written as its two bf16 halves."""
  y = _conv(x_ref[...], halo_ref[...], reach_ref[...], w_ref, taps)
  dy = pre_activation_grad(y, dout_ref[...].astype(F32), x_ref.dtype, normalize)
  dy_hi_ref[...], dy_lo_ref[...] = _halves(dy)


def _dx_kernel(x_ref, reach_ref, reach_next_ref, w_ref, dy_hi_ref, dy_lo_ref, dy_hi_next_ref,
               dy_lo_next_ref, dx_ref, dw_ref, *, taps, blocks):
  """The two-kernel backward's second half: dx and the block's partial dw from dy. The tap
    is per channel, so it commutes with the (transposed) shift: dy's halves shift as read.
    Each (token, token s earlier) pair of dw counts in the earlier token's block: dw's row
    K-1-s sums x times dy shifted s tokens back, the product dx takes anyway (no halo of x)."""
  x, reach = x_ref[...].astype(F32), reach_ref[...]
  dy_hi, dy_lo = dy_hi_ref[...], dy_lo_ref[...]
  dy = dy_hi.astype(F32) + dy_lo.astype(F32)
  # the last block has no next one (its spec reads this block's end again): reach no token
  reach_next = jnp.where(pl.program_id(1) < blocks - 1, reach_next_ref[...], -1)
  next_hi, next_lo = dy_hi_next_ref[...], dy_lo_next_ref[...]
  bt = x.shape[0]
  row = jax.lax.broadcasted_iota(jnp.int32, (dw_ref.shape[0], 1), 0)
  dw = jnp.where(row == taps - 1, jnp.sum(dy * x, axis=0)[None, :], 0.0)
  dx = dy * _tap(w_ref, taps - 1)
  for s in range(1, taps):
    later = (_apply(_shift(bt, bt, s, 0, reach[None, :], False), dy_hi, dy_lo) +
             _apply(_shift(bt, HALO, s, bt, reach_next[None, :], False), next_hi, next_lo))
    dx = dx + later * _tap(w_ref, taps - 1 - s)
    dw = dw + jnp.where(row == taps - 1 - s, jnp.sum(later * x, axis=0)[None, :], 0.0)
  dx_ref[...] = dx.astype(dx_ref.dtype)
  dw_ref[...] = dw


def _block_tokens(length: int, asked: int | None) -> int:
  """The tokens of a program's block: `asked` (a power of two >= 16 dividing the length),
    or the largest of BLOCK_TOKENS dividing it."""
  if asked is not None:
    if asked < HALO or asked & (asked - 1) or length % asked:
      raise ValueError(f"short_conv_silu: block_tokens={asked}: must be a power of two "
                       f">= {HALO} that divides the length {length}")
    return asked
  return next(bt for bt in BLOCK_TOKENS if length % bt == 0)


def _taps_padded(taps: int) -> int:
  return max(2, 1 << (taps - 1).bit_length())


def _specs(B, T, H, D, bt):
  step = bt // HALO
  last = T // HALO - 1
  block = pl.BlockSpec((_sq, bt, _sq, D), lambda b, c, h: (b, c, h, 0))
  before = pl.BlockSpec((_sq, HALO, _sq, D), lambda b, c, h:
                        (b, jnp.maximum(c * step - 1, 0), h, 0))
  after = pl.BlockSpec((_sq, HALO, _sq, D), lambda b, c, h: (b, jnp.minimum(
      (c + 1) * step, last), h, 0))
  reach = pl.BlockSpec((_sq, bt), lambda b, c, h: (b, c))
  reach_after = pl.BlockSpec((_sq, HALO), lambda b, c, h: (b, jnp.minimum((c + 1) * step, last)))
  return block, before, after, reach, reach_after


def _call(kernel, name, x, bt, in_specs, out_specs, out_shape, interpret):
  """One program per (row, block of bt tokens, head) of x."""
  B, T, H, _ = x.shape
  return pl.pallas_call(
      kernel,
      grid=(B, T // bt, H),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret,
      name=name,
  )


def _forward(x, w_taps, reach, taps, normalize, interpret, bt):
  B, T, H, D = x.shape
  block, before, _, reach_spec, _ = _specs(B, T, H, D, bt)
  weights = pl.BlockSpec((_sq, w_taps.shape[1], D), lambda b, c, h: (h, 0, 0))
  return _call(functools.partial(_forward_kernel, taps=taps, normalize=normalize),
               "short_conv_silu", x, bt, [block, before, reach_spec, weights], block,
               jax.ShapeDtypeStruct(x.shape, x.dtype), interpret)(x, x, reach, w_taps)


def _backward(x, w_taps, reach, dout, taps, normalize, interpret, bt, form):
  B, T, H, D = x.shape
  block, before, after, reach_spec, reach_after = _specs(B, T, H, D, bt)
  kp = w_taps.shape[1]
  weights = pl.BlockSpec((_sq, kp, D), lambda b, c, h: (h, 0, 0))
  partial = pl.BlockSpec((_sq, _sq, _sq, kp, D), lambda b, c, h: (b, c, h, 0, 0))
  grads = [
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      jax.ShapeDtypeStruct((B, T // bt, H, kp, D), F32)
  ]
  if form == "one_kernel":
    kernel = functools.partial(_backward_kernel, taps=taps, normalize=normalize, blocks=T // bt)
    specs = [block, before, after, reach_spec, reach_after, weights, block, after]
    dx, dw = _call(kernel, "short_conv_silu_bwd", x, bt, specs, [block, partial], grads,
                   interpret)(x, x, x, reach, reach, w_taps, dout, dout)
  else:
    kernel = functools.partial(_dy_kernel, taps=taps, normalize=normalize)
    specs = [block, before, reach_spec, weights, block]
    halves = [jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)] * 2
    dy_hi, dy_lo = _call(kernel, "short_conv_silu_bwd_dy", x, bt, specs, [block, block], halves,
                         interpret)(x, x, reach, w_taps, dout)
    kernel = functools.partial(_dx_kernel, taps=taps, blocks=T // bt)
    specs = [block, reach_spec, reach_after, weights, block, block, after, after]
    dx, dw = _call(kernel, "short_conv_silu_bwd_dx", x, bt, specs, [block, partial], grads,
                   interpret)(x, reach, reach, w_taps, dy_hi, dy_lo, dy_hi, dy_lo)
  return dx, jnp.sum(dw, axis=(0, 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _fused(x, w_taps, reach, taps, normalize, interpret, blocks, backward):
  return _forward(x, w_taps, reach, taps, normalize, interpret, blocks[0])


def _fused_fwd(x, w_taps, reach, taps, normalize, interpret, blocks, backward):
  return _forward(x, w_taps, reach, taps, normalize, interpret, blocks[0]), (x, w_taps, reach)


def _fused_bwd(taps, normalize, interpret, blocks, backward, residuals, dout):
  x, w_taps, reach = residuals
  dx, dw = _backward(x, w_taps, reach, dout, taps, normalize, interpret, blocks[1], backward)
  return dx, dw, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def short_conv_silu(x: jax.Array, weight: jax.Array, segment_ids: jax.Array | None = None, *,
                    normalize: bool = False, block_tokens: tuple[int | None,
                                                                 int | None] = (None, None),
                    backward: str = "two_kernels", form: str = "rows") -> jax.Array:
  """short_conv_silu_reference's result in one Pallas pass (interpreted on CPU). x: [B, T,
    H, D]; weight: [H, D, K] with tap K-1 on the current token, K <= 17; segment_ids:
    [B, T] or None. block_tokens: the forward's and the backward's tokens per program
    (None: the forward the largest of BLOCK_TOKENS dividing T, the backward
    BACKWARD_BLOCK_TOKENS). backward: one of BACKWARDS (the module docstring). form: one of
    FORMS: "rows" (the default, the faster: docs/performance.md, "The prologue's rows form"),
    each program streaming one head's rows (pallas_kernels/short_conv/rows.py), or "blocks",
    the kernels of this module (block_tokens and backward are theirs). Lengths that are not a
    multiple of 16 run the reference."""
  if backward not in BACKWARDS:
    raise ValueError(f"short_conv_silu: backward={backward!r}: expected one of {BACKWARDS}")
  if form not in FORMS:
    raise ValueError(f"short_conv_silu: form={form!r}: expected one of {FORMS}")
  B, T, H, D = x.shape
  taps = weight.shape[-1]
  if weight.shape[:2] != (H, D):
    raise ValueError(f"short_conv_silu: weight {weight.shape} does not match x's heads and "
                     f"channels {(H, D)}")
  if T % HALO or taps - 1 > HALO:
    return short_conv_silu_reference(x, weight, segment_ids, normalize=normalize)
  forward, backward_asked = block_tokens
  blocks = (_block_tokens(T, forward), _block_tokens(T, backward_asked or BACKWARD_BLOCK_TOKENS))
  kp = _taps_padded(taps)
  w_taps = jnp.pad(jnp.moveaxis(weight.astype(F32), -1, 1), ((0, 0), (0, kp - taps), (0, 0)))
  reach = token_reach(segment_ids, B, T, taps)
  interpret = jax.default_backend() == "cpu"
  if form == "rows":
    return by_rows(x, w_taps, reach, taps, normalize, interpret)
  return _fused(x, w_taps, reach, taps, normalize, interpret, blocks, backward)

"""residual_mix as one fused Pallas pass (reads x and every history slice once, writes
the mix once) with an XLA backward.

The forward runs on the Pallas Triton backend on GPU and is interpreted on CPU. The
backward is elementwise plus one reduction per weight, which XLA already fuses well.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.residual_mix.input_checks import check_residual_mix_inputs

F32 = jnp.float32
_BLOCK_ROWS = 64
_MAX_BLOCK_COLS = 1024


def _mix_kernel(w_ref, x_ref, *refs):
  *history_refs, out_ref = refs
  acc = w_ref[0] * x_ref[...].astype(F32)
  for j, h_ref in enumerate(history_refs):
    acc = acc + w_ref[j + 1] * h_ref[...].astype(F32)
  out_ref[...] = acc.astype(out_ref.dtype)


def _blocks(rows: int, cols: int) -> tuple[int, int]:
  """Power-of-two tiles: rows padded up to the row block, columns split evenly."""
  block_cols = min(cols & -cols, _MAX_BLOCK_COLS)  # largest power of two dividing cols
  block_rows = min(_BLOCK_ROWS, 1 << max(0, (rows - 1).bit_length()))
  return block_rows, block_cols


def _fused_mix(x2, h3, weights):
  """x2 [N, d], h3 [W, N, d], weights [W + 1] -> [N, d]."""
  (n, d), width = x2.shape, h3.shape[0]
  bn, bd = _blocks(n, d)
  n_pad = -(-n // bn) * bn
  if n_pad != n:
    x2 = jnp.pad(x2, ((0, n_pad - n), (0, 0)))
    h3 = jnp.pad(h3, ((0, 0), (0, n_pad - n), (0, 0)))
  w_len = 1 << (width).bit_length()  # power-of-two weight block, zero padded
  w = jnp.pad(weights.astype(F32), (0, w_len - width - 1))
  tile = pl.BlockSpec((bn, bd), lambda i, j: (i, j))
  history_specs = [pl.BlockSpec((None, bn, bd), lambda i, j, s=s: (s, i, j)) for s in range(width)]
  out = pl.pallas_call(
      _mix_kernel,
      grid=(n_pad // bn, d // bd),
      in_specs=[pl.BlockSpec((w_len,), lambda i, j: (0,)), tile, *history_specs],
      out_specs=tile,
      out_shape=jax.ShapeDtypeStruct((n_pad, d), x2.dtype),
      interpret=jax.default_backend() == "cpu",
      name="residual_mix",
  )(w, x2, *([h3] * width))
  return out[:n]


@jax.custom_vjp
def _mix(x, history, weights):
  d = x.shape[-1]
  return _fused_mix(x.reshape(-1, d), history.reshape(history.shape[0], -1, d),
                    weights).reshape(x.shape)


def _mix_fwd(x, history, weights):
  return _mix(x, history, weights), (x, history, weights)


def _mix_bwd(res, dy):
  x, history, weights = res
  dy32 = dy.astype(F32)
  w = weights.astype(F32)
  dx = (w[0] * dy32).astype(x.dtype)
  dh = (w[1:].reshape(-1, *([1] * x.ndim)) * dy32[None]).astype(history.dtype)
  dw0 = jnp.sum(dy32 * x.astype(F32))
  dwh = jnp.einsum("...,w...->w", dy32, history.astype(F32))
  return dx, dh, jnp.concatenate([dw0[None], dwh]).astype(weights.dtype)


_mix.defvjp(_mix_fwd, _mix_bwd)


def residual_mix(x, history, weights):
  """Same contract as residual_mix_reference."""
  check_residual_mix_inputs(x, history, weights)
  return _mix(x, history, weights)

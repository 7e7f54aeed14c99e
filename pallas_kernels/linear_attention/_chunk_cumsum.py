"""The in-chunk cumulative log decay b = cumsum(g) per 64-token chunk, as a Pallas kernel.

One two-warp program per (chunk, head) scans its [C, D] block in registers, in about
the time a copy of the same blocks takes (XLA's cumulative sum over an inner axis of
[B, T, H, D] is slower). Its transpose, the reverse in-chunk sum of the cotangent, is the
same kernel's other mode: sum(x) - cumsum(x) + x (Triton scans only forwards), with four
warps (with two it would spill: experiments/kernel_resources.py).
Chosen by measurement: docs/kernel_tuning.md, "In-chunk cumulative sum".
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention._inputs import CHUNK as C
from pallas_kernels.linear_attention._pallas_common import F32, compiler_params, interpret_mode

_sq = pl.squeezed


def _scan_kernel(x_ref, y_ref, *, reverse):
  x = x_ref[...].astype(F32)
  s = jnp.cumsum(x, axis=0)
  y_ref[...] = (jnp.sum(x, axis=0, keepdims=True) - s + x) if reverse else s


def _scan(x, reverse):
  B, Tp, H, D = x.shape
  block = pl.BlockSpec((_sq, C, _sq, D), lambda b, c, h: (b, c, h, 0))
  return pl.pallas_call(
      functools.partial(_scan_kernel, reverse=reverse),
      grid=(B, Tp // C, H),
      in_specs=[block],
      out_specs=block,
      out_shape=jax.ShapeDtypeStruct(x.shape, F32),
      compiler_params=compiler_params(4 if reverse else 2),
      interpret=interpret_mode(),
      name="chunk_reverse_cumsum" if reverse else "chunk_cumsum",
  )(x)


def chunk_cumsum(g):
  """[B, Tp, H, D] (Tp a multiple of the chunk) -> fp32 cumulative sum restarted at
    every chunk."""
  return _chunk_cumsum_f32(g.astype(F32))


@jax.custom_vjp
def _chunk_cumsum_f32(g):
  return _scan(g, reverse=False)


def _fwd(g):
  return _scan(g, reverse=False), None


def _bwd(_, db):
  return (_scan(db, reverse=True),)


_chunk_cumsum_f32.defvjp(_fwd, _bwd)

"""The in-chunk cumulative log decay b = cumsum(g) per 64-token chunk, as a Pallas kernel;
and `decay_cumsum`, the same sum of a KDA decay computed in the kernel from its gate
projection (decay_gate.DecayGate), with a backward that writes the projection's gradient
and per-chunk shares of the gate parameters' gradients.

One two-warp program per (chunk, head) scans its [C, D] block in registers, in about
the time a copy of the same blocks takes (XLA's cumulative sum over an inner axis of
[B, T, H, D] is slower). Its transpose, the reverse in-chunk sum of the cotangent, is the
same kernel's other mode: sum(x) - cumsum(x) + x (Triton scans only forwards), with four
warps (with two it would spill: experiments/kernel_resources.py). `chunk_cumsum_and_layouts`
writes each chunk's scores layout beside the sum, from the rows the program holds.
Chosen by measurement: docs/kernel_tuning.md, "In-chunk cumulative sum".
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention import _chunk_factors as factors
from pallas_kernels.linear_attention import decay_gate as gate
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


def reverse_chunk_cumsum(db):
  """The transpose of chunk_cumsum, fp32: the gradient of the log decays for that of their
    in-chunk cumulative sum db [B, Tp, H, D] (for a kernel that sums the decays itself)."""
  return _scan(db.astype(F32), reverse=True)


def _bwd(_, db):
  return (reverse_chunk_cumsum(db),)


_chunk_cumsum_f32.defvjp(_fwd, _bwd)

# ---- the same sum with each chunk's scores layout, from the rows it holds ---------------


def _scan_and_layout_kernel(x_ref, y_ref, layout_ref):
  s = jnp.cumsum(x_ref[...].astype(F32), axis=0)
  y_ref[...] = s
  factors.record_layout_from_rows(layout_ref, s, write_rows=lambda: None)


def _scan_and_layouts(x):
  B, Tp, H, D = x.shape
  block = pl.BlockSpec((_sq, C, _sq, D), lambda b, c, h: (b, c, h, 0))
  layout = pl.BlockSpec((_sq, _sq, _sq, C), lambda b, c, h: (b, h, c, 0))
  return pl.pallas_call(
      _scan_and_layout_kernel,
      grid=(B, Tp // C, H),
      in_specs=[block],
      out_specs=[block, layout],
      out_shape=[
          jax.ShapeDtypeStruct(x.shape, F32),
          jax.ShapeDtypeStruct((B, H, Tp // C, C), jnp.int32)
      ],
      compiler_params=compiler_params(2),
      interpret=interpret_mode(),
      name="chunk_cumsum_and_layouts",
  )(x)


def chunk_cumsum_and_layouts(g):
  """(chunk_cumsum(g), each chunk's scores layout [B, H, n, C] int32 as the first scores
    kernel records it, _chunk_factors.record_layout_from_rows): from the rows the sum holds, for
    the scores' kernels that need every chunk's before their first (_kda_scores.
    HALVES_ROWS_IN_THEIR_KERNEL)."""
  return _chunk_cumsum_and_layouts_f32(g.astype(F32))


@jax.custom_vjp
def _chunk_cumsum_and_layouts_f32(g):
  return _scan_and_layouts(g)


def _and_layouts_fwd(g):
  return _scan_and_layouts(g), None


def _and_layouts_bwd(_, cts):
  return (reverse_chunk_cumsum(cts[0]),)


_chunk_cumsum_and_layouts_f32.defvjp(_and_layouts_fwd, _and_layouts_bwd)

# ---- the KDA decay gate in the same pass (decay_gate.DecayGate) -------------------------

# Channels and warps of a program, forward and backward: no spills and the most programs
# per SM by ptxas (experiments/kernel_resources.py; untimed): forward 64 registers, 4
# programs; backward 75 registers, 3 programs (a whole head's 128 channels: 255, 1).
GATE_BLOCKS, GATE_WARPS = (64, 32), (8, 8)


def _tokens(chunk):
  """[C, 1] positions in the (padded) sequence of the rows of chunk `chunk`."""
  return chunk * C + jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0)


def _gate_scan_kernel(f_ref, rate_ref, bias_ref, b_ref, *, lower_bound, valid):
  u = f_ref[...].astype(F32) + bias_ref[...][None, :]
  g = gate.apply(u, rate_ref[...][None, :], lower_bound)
  # padding tokens (at and after `valid`) decay by nothing, as padded g = 0 would
  g = jnp.where(_tokens(pl.program_id(1)) < valid, g, 0.0)
  b_ref[...] = jnp.cumsum(g, axis=0)


def _gate_scan_grad_kernel(db_ref, f_ref, rate_ref, bias_ref, df_ref, dbias_ref, drate_ref, *,
                           lower_bound, valid):
  db = db_ref[...]
  dg = jnp.sum(db, axis=0, keepdims=True) - jnp.cumsum(db, axis=0) + db
  dg = jnp.where(_tokens(pl.program_id(1)) < valid, dg, 0.0)
  u = f_ref[...].astype(F32) + bias_ref[...][None, :]
  du, d_rate = gate.derivatives(u, rate_ref[...][None, :], lower_bound)
  df = dg * du
  df_ref[...] = df.astype(df_ref.dtype)
  dbias_ref[...] = jnp.sum(df, axis=0)  # this chunk's share: summed over chunks in XLA
  drate_ref[...] = jnp.sum(dg * d_rate, axis=0)


def _gate_specs(B, Tp, H, D, block_d):
  """One program per (row, chunk, head, block of `block_d` channels): the channels are
    independent, and a whole [64, 128] block of the backward's fp32 terms would fill the
    registers of eight warps (experiments/kernel_resources.py)."""
  block_d = min(block_d, D)
  tokens = pl.BlockSpec((_sq, C, _sq, block_d), lambda b, c, h, j: (b, c, h, j))
  per_head = pl.BlockSpec((_sq, block_d), lambda b, c, h, j: (h, j))
  per_chunk = pl.BlockSpec((_sq, _sq, _sq, block_d), lambda b, c, h, j: (b, c, h, j))
  return (B, Tp // C, H, D // block_d), tokens, per_head, per_chunk


def _gate_scan(f, rate, bias, lower_bound, valid):
  grid, tokens, per_head, _ = _gate_specs(*f.shape, GATE_BLOCKS[0])
  return pl.pallas_call(
      functools.partial(_gate_scan_kernel, lower_bound=lower_bound, valid=valid),
      grid=grid,
      in_specs=[tokens, per_head, per_head],
      out_specs=tokens,
      out_shape=jax.ShapeDtypeStruct(f.shape, F32),
      compiler_params=compiler_params(GATE_WARPS[0]),
      interpret=interpret_mode(),
      name="decay_gate_cumsum",
  )(f, rate, bias)


def _gate_scan_grad(db, f, rate, bias, lower_bound, valid):
  B, Tp, H, D = f.shape
  grid, tokens, per_head, per_chunk = _gate_specs(B, Tp, H, D, GATE_BLOCKS[1])
  partial = jax.ShapeDtypeStruct((B, Tp // C, H, D), F32)
  return pl.pallas_call(
      functools.partial(_gate_scan_grad_kernel, lower_bound=lower_bound, valid=valid),
      grid=grid,
      in_specs=[tokens, tokens, per_head, per_head],
      out_specs=[tokens, per_chunk, per_chunk],
      out_shape=[jax.ShapeDtypeStruct(f.shape, f.dtype), partial, partial],
      compiler_params=compiler_params(GATE_WARPS[1]),
      interpret=interpret_mode(),
      name="decay_gate_reverse_cumsum",
  )(db, f, rate, bias)


def decay_cumsum(f, decay, valid):
  """The in-chunk cumulative sum of g = decay(f) (a decay_gate.DecayGate), fp32 [B, Tp,
    H, D], for the gate projection f [B, Tp, H, D] padded to a multiple of the chunk: g
    computed in the kernel (fp32) and never written; tokens at and after `valid` decay by
    nothing. Differentiable in f, decay.a_log and decay.dt_bias."""
  H, D = f.shape[2:]
  rate = jnp.broadcast_to(decay.rate(), (H, D))
  return _decay_cumsum(f, rate, decay.dt_bias.astype(F32), decay.lower_bound, valid)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _decay_cumsum(f, rate, bias, lower_bound, valid):
  return _gate_scan(f, rate, bias, lower_bound, valid)


def _decay_fwd(f, rate, bias, lower_bound, valid):
  return _gate_scan(f, rate, bias, lower_bound, valid), (f, rate, bias)


def _decay_bwd(lower_bound, valid, residuals, db):
  df, dbias, drate = _gate_scan_grad(db, *residuals, lower_bound, valid)
  return df, drate.sum(axis=(0, 1)), dbias.sum(axis=(0, 1))


_decay_cumsum.defvjp(_decay_fwd, _decay_bwd)

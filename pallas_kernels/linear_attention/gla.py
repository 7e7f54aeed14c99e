"""chunked_gla: Pallas chunked gated linear attention with a Pallas backward (custom_vjp).

Forward: a thin sequential kernel computes every chunk's start state (_gla_states, or
_gla_states_mosaic on Hopper: Tiling.state_walk), parallel kernels each chunk's in-chunk
scores A (_gla_scores) and, per block of value channels, its output (_gla_chunks); or,
with Tiling.forward = "fused", the scores kernel and one Mosaic GPU kernel that walks the
states and computes the outputs (_gla_forward_mosaic); that forward alone reads no more
of the summed decays than each chunk's last row, and the scores kernel writes no more
(Tiling.summed_rows). Backward: the residuals are the
inputs, A (in the compute dtype, as much memory as v) and the per-chunk start states that
either forward writes (as much as q and k together at Dv = 128; a remat policy that saves
neither runs the forward again); a reverse sequential kernel gives each chunk's end-state
gradient, parallel kernels the score gradients dA, dv per value block, and dq, dk and the decay
gradient per block of key channels.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import residuals
from pallas_kernels.linear_attention import (_chunk_prep, _gla_forward_mosaic, _gla_states,
                                             _gla_states_mosaic)
from pallas_kernels.linear_attention._chunk_cumsum import reverse_chunk_cumsum
from pallas_kernels.linear_attention._chunk_factors import SCORE_KERNELS, SCORE_OPERANDS
from pallas_kernels.linear_attention._gla_chunks import (chunk_key_grads, chunk_outputs,
                                                         chunk_value_grads)
from pallas_kernels.linear_attention._gla_scores import chunk_score_grads, chunk_scores
from pallas_kernels.linear_attention._inputs import (check_head_dims, check_tile, default_scale,
                                                     validate)
from pallas_kernels.linear_attention._mosaic_common import (choose_mosaic_or, choose_walk,
                                                            forward_value_tile, sixteen_bit)
from pallas_kernels.linear_attention._pallas_common import SUMMED_ROWS, interpret_mode


class Tiling(NamedTuple):
  """Launch settings (hashable: they are static arguments of the custom VJP).
    Defaults chosen by measurement: docs/kernel_tuning.md, "GLA tiling"."""
  block_k: int = 64
  block_v: int = 64
  state_warps: int = 4
  state_stages: int = 3
  chunk_warps: int = 2  # forward outputs
  score_warps: int = 4  # the scores kernel, one program per chunk
  score_stages: int = 2  # loads in flight in the score kernel's loops
  grad_warps: int = 4  # backward: score gradients, value and key gradients
  grad_stages: int = 2  # loads in flight in the key-gradient kernel's sub-chunk loop
  # value channels per program of the value-gradient kernel: whole 128-wide heads read
  # the chunk's keys and decays once (the forward outputs kernel keeps block_v)
  grad_block_v: int = 128
  # value channels per program of the fused forward, a width or "by_heads" (by the number
  # of (batch row, head) chains: _mosaic_common.forward_value_tile)
  forward_block_v: int | str = "by_heads"
  # the two sequential kernels (chunk states, state gradients): "mosaic" (Hopper: TMA
  # and warpgroup matmuls) or "triton"; "auto" takes "mosaic" where it runs
  # (state_walk_kind)
  state_walk: str = "auto"
  # "split" or "fused" (_FORWARDS; the fused forward runs on Mosaic GPU, Hopper only);
  # both hand the per-chunk states to the backward. "auto" takes "fused" where it runs
  # (docs/kernel_tuning.md, "GLA tiling")
  forward: str = "auto"
  # the fused forward's decayed rows qg, kg: written by the scores kernel ("scores", the
  # faster) or by one XLA fusion beside it ("xla"); docs/kernel_tuning.md, "GLA tiling"
  decayed_rows: str = "scores"
  # the scores' kernels, a form of _chunk_factors.SCORE_KERNELS: one that branches per
  # chunk ("one_kernel", 2-10% faster forwards than by_layout, docs/performance.md,
  # "Layouts from the chunk's end rows") or the WHOLE_CHUNK chunks', then the others' into
  # its output ("by_layout"); _gla_scores
  scores: str = "one_kernel"
  # the key gradients' kernels: one that branches per chunk ("one_kernel") or the
  # one-anchor chunks', then the others' ("by_layout"); _gla_chunks.chunk_key_grads
  key_grads: str = "one_kernel"
  # where the in-chunk cumulative decay is summed (DECAY_SUMS): in the (first) scores
  # kernel on its way ("in_scores": one pass over the decays fewer, 3-4% faster forwards,
  # docs/performance.md, "The L2 norm as row scales; the decays summed in the scores
  # kernel") or in a kernel of its own before the others ("own_kernel", _chunk_cumsum)
  decay_sum: str = "in_scores"
  # the operand dtype of the factored score products (_chunk_factors.SCORE_OPERANDS):
  # "compute" (A's own dtype, bf16 for bf16 inputs; the faster, docs/performance.md, "Score
  # products on bf16 operands") or "fp32" (TF32 on the GPU)
  score_operands: str = "compute"
  # the rows of the summed decays the scores kernel writes in the fused forward alone
  # (_pallas_common.SUMMED_ROWS): "chunk_ends" (each chunk's last row, read by the state
  # factors, and the rows of the chunks that read theirs back) or "all" (as the backward
  # needs them); with the decays summed in the one scores kernel and the decayed rows from
  # it, else "all" (docs/kernel_tuning.md, "GLA tiling")
  summed_rows: str = "chunk_ends"
  interpret: bool = False


# GLA's key gradients come in two of _chunk_factors.KEY_GRAD_KERNELS' forms
_KEY_GRAD_FORMS = ("one_kernel", "by_layout")
DECAY_SUMS = ("own_kernel", "in_scores")


def state_walk_kind(t: Tiling, dtypes, Dk, Dv):
  """The state kernels' implementation: the Mosaic GPU walk needs q, k, v in one 16-bit
    dtype and 64-wide state tiles, and compiles for Hopper only (interpreted on CPU when
    asked for)."""
  block = _gla_states_mosaic.BLOCK
  return choose_walk(
      t.state_walk, _STATE_WALKS,
      sixteen_bit(dtypes) and Dk % block == 0 and Dv % block == 0, t.interpret,
      f"q, k, v in one 16-bit dtype and head sizes that are multiples of "
      f"{block}; got {[str(d) for d in dtypes]}, Dk = {Dk}, Dv = {Dv}")


def _triton_walks(t: Tiling):
  kw = dict(block_k=t.block_k, block_v=t.block_v, interpret=t.interpret, num_warps=t.state_warps,
            num_stages=t.state_stages)
  return (functools.partial(_gla_states.chunk_states,
                            **kw), functools.partial(_gla_states.chunk_state_grads, **kw))


def _mosaic_walks(t: Tiling):
  return (functools.partial(_gla_states_mosaic.chunk_states, interpret=t.interpret),
          functools.partial(_gla_states_mosaic.chunk_state_grads, interpret=t.interpret))


_STATE_WALKS = {"triton": _triton_walks, "mosaic": _mosaic_walks}


def state_walks(t: Tiling):
  """(chunk_states, chunk_state_grads) of t.state_walk ("auto" resolved), settings bound."""
  return _STATE_WALKS[t.state_walk](t)


def _states(k, v, b, masks, h0, t: Tiling):
  carry_in, in_last = masks
  return state_walks(t)[0](k, v, b, in_last, carry_in, h0)


def _scores(q, k, b, runs, t, decayed_with=None, summed_rows="all"):
  """chunk_scores with t's settings: (A, [qg, kg,] b), b summed there from the log decays
    given as b where t.decay_sum says so (its rows as summed_rows says, where the kernel's
    form writes them so), else b as given."""
  from_gates = t.decay_sum == "in_scores"
  if not (from_gates and t.scores == "one_kernel"):
    summed_rows = "all"
  out = chunk_scores(q, k, b, runs, interpret=t.interpret, num_warps=t.score_warps,
                     num_stages=t.score_stages, form=t.scores, decayed_with=decayed_with,
                     from_gates=from_gates, operands=t.score_operands, summed_rows=summed_rows)
  out = out if isinstance(out, tuple) else (out,)
  return out if from_gates else (*out, b)


def _split_forward(q, k, v, b, h0, runs, masks, scale, t, with_states):
  del with_states  # the outputs kernel reads them: always in memory
  a, b = _scores(q, k, b, runs, t)
  h, ht = _states(k, v, b, masks, h0, t)
  o = chunk_outputs(q, v, b, masks[0], h, a, scale=scale, block_v=t.block_v, interpret=t.interpret,
                    num_warps=t.chunk_warps)
  return (o, ht), a, h, b


def _fused_forward(q, k, v, b, h0, runs, masks, scale, t, with_states):
  if t.decayed_rows == "scores":
    # without the states, the kernel after the scores reads each chunk's last row of b alone
    summed_rows = "all" if with_states else t.summed_rows
    a, qg, kg, b = _scores(q, k, b, runs, t, decayed_with=masks, summed_rows=summed_rows)
  else:
    a, b = _scores(q, k, b, runs, t)
    qg, kg = _chunk_prep.decayed_rows(q, k, b, *masks, a.dtype)
  o, ht, *h = _gla_forward_mosaic.gla_forward(qg, kg, v, a, b, masks[0], h0, scale=scale,
                                              interpret=t.interpret, with_states=with_states,
                                              block_v=t.forward_block_v)
  return (o, ht), a, (h[0] if with_states else None), b


# Tiling.forward: "split" (state kernel, then the outputs kernel) or "fused" (the
# decayed q and k rows from the scores kernel or XLA, Tiling.decayed_rows; one Mosaic GPU
# kernel walks the states and computes the outputs, writing the per-chunk states only for
# the backward)
_FORWARDS = {"split": _split_forward, "fused": _fused_forward}
_DECAYED_ROWS = ("scores", "xla")


def _forward(q, k, v, b, h0, runs, masks, scale, t, with_states=False):
  """((o, final state), A, the per-chunk states where with_states asks for them or the
    forward writes them anyway, else None, b: the in-chunk cumulative decay, summed in the
    scores kernel from the log decays given as b where t.decay_sum is "in_scores")."""
  return _FORWARDS[t.forward](q, k, v, b, h0, runs, masks, scale, t, with_states)


def check_forward(t: Tiling, dtypes, Dk, Dv):
  """t with Tiling.forward resolved ("auto": "fused" where it runs, else "split"), after
    checking that the forward's settings name what can run here."""
  if t.decayed_rows not in _DECAYED_ROWS:
    raise ValueError(f"Tiling.decayed_rows = {t.decayed_rows!r}: expected one of "
                     f"{sorted(_DECAYED_ROWS)}")
  known_values = {
      "scores": SCORE_KERNELS,
      "key_grads": _KEY_GRAD_FORMS,
      "decay_sum": DECAY_SUMS,
      "score_operands": SCORE_OPERANDS,
      "summed_rows": SUMMED_ROWS
  }
  for name, known in known_values.items():
    if getattr(t, name) not in known:
      raise ValueError(f"Tiling.{name} = {getattr(t, name)!r}: expected one of "
                       f"{list(known)}")
  tile = t.forward_block_v
  fits = (sixteen_bit(dtypes) and Dk % 64 == 0 and Dk <= _gla_forward_mosaic.MAX_DK and
          tile % 32 == 0)
  forward = choose_mosaic_or(
      "Tiling.forward", t.forward, _FORWARDS, "fused", "split", fits, t.interpret,
      f"q, k, v in one 16-bit dtype, Dk of 64 or 128 and a forward value tile that is a "
      f"multiple of 32; got {[str(d) for d in dtypes]}, Dk = {Dk}, forward_block_v = {tile}")
  return t._replace(forward=forward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _gla_core(q, k, v, b, h0, runs, masks, scale, t):
  return _forward(q, k, v, b, h0, runs, masks, scale, t)[0]


def _gla_core_fwd(q, k, v, b, h0, runs, masks, scale, t):
  # with the decays summed in the scores kernel, the log decays' dtype (a 0-d array) is
  # kept for their gradient's
  out, a, h, bs = _forward(q, k, v, b, h0, runs, masks, scale, t, with_states=True)
  a, = residuals.keep(a)  # kept with the core's output by a remat policy saving "attention"
  return out, (q, k, v, bs, h0, runs, masks, a, h, jnp.zeros((), b.dtype))


def _gla_core_bwd(scale, t, res, cts):
  q, k, v, b, h0, runs, masks, a, h, decays = res
  do, dht = cts
  do = do.astype(v.dtype)
  ds, dh0 = state_walks(t)[1](q, b, masks[0], do, dht, scale=scale)
  dv = chunk_value_grads(k, b, masks[1], ds, a, do, scale=scale, block_v=t.grad_block_v,
                         interpret=t.interpret, num_warps=t.grad_warps)
  da, dat = chunk_score_grads(v, runs, do, scale=scale, interpret=t.interpret,
                              num_warps=t.grad_warps)
  dq, dk, db = chunk_key_grads(q, k, v, b, *masks, h, ds, do, da, dat, scale=scale,
                               block_k=t.block_k, interpret=t.interpret, num_warps=t.grad_warps,
                               num_stages=t.grad_stages, by_layout=t.key_grads == "by_layout")
  if t.decay_sum == "in_scores":  # the gradient of the log decays, through the kernel's sum
    db = reverse_chunk_cumsum(db).astype(decays.dtype)
  return dq, dk, dv, db, dh0, None, None


_gla_core.defvjp(_gla_core_fwd, _gla_core_bwd)


def chunked_gla(q, k, v, g, *, scale=None, initial_state=None, segment_ids=None,
                output_final_state=False, tiling: Tiling | None = None):
  """Chunked GLA on Pallas kernels; same contract as reference.gla_chunked. g: the
    per-channel log decay, <= 0 (each chunk's layout is read from the rows that bound its
    cumulative decay, which falls: _chunk_factors.midpoint)."""
  B, T, H, Dk, Dv = validate(q, k, v, g, None, initial_state, segment_ids)
  check_head_dims(Dk, Dv)
  scale = default_scale(scale, Dk)
  t = tiling or Tiling()
  qp, kp, vp, b, runs = _chunk_prep.prepare(q, k, v, g, segment_ids, B, T, summed=t.decay_sum
                                            != "in_scores")
  masks = _chunk_prep.segment_masks(runs)
  h0 = (jnp.zeros(
      (B, H, Dk, Dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32))
  t = t._replace(interpret=interpret_mode())
  widths = {  # each tile: its width, capped at its dimension, which it must divide
      "block_k": (min(t.block_k, Dk), "Dk", Dk),
      "block_v": (min(t.block_v, Dv), "Dv", Dv),
      "grad_block_v": (min(t.grad_block_v, Dv), "Dv", Dv),
      "forward_block_v": (forward_value_tile(t.forward_block_v, B, H, Dv), "Dv", Dv),
  }
  t = t._replace(**{name: check_tile(name, *width) for name, width in widths.items()})
  dtypes = (q.dtype, k.dtype, v.dtype)
  t = check_forward(t._replace(state_walk=state_walk_kind(t, dtypes, Dk, Dv)), dtypes, Dk, Dv)
  o, ht = _gla_core(qp, kp, vp, b, h0, runs, masks, float(scale), t)
  return o[:, :T], (ht if output_final_state else None)

"""chunked_kda: Pallas chunked KDA (gated delta rule, per-channel decay) with a Pallas
backward (custom_vjp). Same contract as reference.kda_chunked.

Forward, per 64-token chunk (see _kda_intra for the chunk form):
  kda_chunk_scores (parallel) A_kk, A_qk, qg, kg: one kernel per in-chunk layout, or
               the other form of _chunk_factors.SCORE_KERNELS; with scores="by_layout"
               the first also L2-normalises q and k (qk_norm="kernel", the default) and
               can sum the decays (decay_sum="in_scores")
  kda_chunk_solve (parallel) T = (I + A_kk)^-1 by recursive doubling, w, u0; with
               solve="in_scores" the scores' HALVES kernel solves its chunks in place;
               in the fused forward alone with inverse_products="in_walk",
               kda_chunk_inverse writes T alone and the walk applies it
  kda_states   (sequential) start state of every chunk and v_new = u0 - w S
               (_kda_states, or _kda_states_mosaic on Hopper)
  kda_output   (parallel)   o = scale (qg S + A_qk v_new)
or, with forward = "fused", the state walk and the outputs in one Mosaic GPU kernel of two
warpgroups (_kda_forward_mosaic; no per-chunk states read back).
Backward: the forward's in-chunk quantities and chunk states are its residuals, then
  kda_dv_local (parallel)   dv_local = scale A_qk^T do, dP = scale do v_new^T
  kda_state_grads (sequential, reverse) end-state gradients and dv_new
  kda_wy_grads (parallel)   dv, dX = T^T dv_new, dA, part of dbeta
  kda_key_grads (parallel over chunks and key-channel blocks; or two kernels, the forms of
               _chunk_factors.KEY_GRAD_KERNELS) dq, dk, db, rest of dbeta
The scores default to by_layout: on the GPU it is exact in every gate regime, and with
strong gates its kernels take less than half the one kernel's time (docs/performance.md,
"Scores by layout, checked and timed on the GPU"). The key gradients' by_layout form
(also the default) decides each chunk's layout from its decays, without flags.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import residuals
from pallas_kernels.linear_attention import (_chunk_prep, _kda_forward_mosaic, _kda_states,
                                             _kda_states_mosaic)
from pallas_kernels.linear_attention._chunk_factors import (KEY_GRAD_KERNELS, SCORE_KERNELS,
                                                            SCORE_OPERANDS)
from pallas_kernels.linear_attention._inputs import (check_head_dims, check_tile, default_scale,
                                                     l2_normalize, pad_time, validate)
from pallas_kernels.linear_attention._kda_intra import INVERSE_PRODUCTS, SOLVES, chunk_intra
from pallas_kernels.linear_attention._kda_solve import INVERSES
from pallas_kernels.linear_attention._kda_key_grads import chunk_key_grads
from pallas_kernels.linear_attention._chunk_cumsum import reverse_chunk_cumsum
from pallas_kernels.linear_attention._kda_scores import FIRST_KERNEL_FORMS, layouts_before_scores
from pallas_kernels.linear_attention._kda_value_side import (chunk_dv_local, chunk_output,
                                                             chunk_wy_grads)
from pallas_kernels.linear_attention._mosaic_common import (choose_mosaic_or, choose_walk,
                                                            forward_value_tile, on_hopper,
                                                            sixteen_bit)
from pallas_kernels.linear_attention._pallas_common import (SUMMED_ROWS, compute_dtype,
                                                            interpret_mode)

# (chunk_states, chunk_state_grads) per state-walk implementation
_STATE_WALKS = {
    "triton": (_kda_states.chunk_states, _kda_states.chunk_state_grads),
    "mosaic": (_kda_states_mosaic.chunk_states, _kda_states_mosaic.chunk_state_grads),
}


class Tiling(NamedTuple):
  """Static launch settings: value-channel block (all kernels), key-channel block
    (kda_key_grads), the forward and backward state kernels' implementations (keys of
    _STATE_WALKS), the forward's form (keys of _FORWARDS), interpret mode and the in-chunk
    scores' and key gradients' kernels (_chunk_factors.SCORE_KERNELS each)."""
  block_v: int
  block_k: int
  state_walks: tuple[str, str]
  interpret: bool
  forward: str = "split"
  scores: str = "by_layout"
  key_grads: str = "by_layout"
  normalize: bool = False  # q, k L2-normalised by the first scores kernel (qk_norm="kernel")
  solve: str = "own_kernel"  # _kda_intra.SOLVES
  # the decays summed by the first scores kernel (decay_sum="in_scores"): the op takes the
  # log decays g where it would take their in-chunk sum b
  sums_decays: bool = False
  # with sums_decays, the rows of b the first scores kernel writes in the fused forward alone
  # (_pallas_common.SUMMED_ROWS; the forward the backward follows writes every row)
  summed_rows: str = "all"
  score_operands: str = "compute"  # _chunk_factors.SCORE_OPERANDS
  inverse: str = "by_halves"  # _kda_solve.INVERSES
  forward_block_v: int = 64  # the fused forward's value tile (_mosaic_common.forward_value_tile)
  # where T's products are formed in the fused forward alone (_kda_intra.INVERSE_PRODUCTS;
  # the forward the backward follows, and the split forward, keep "in_solve")
  inverse_products: str = "in_solve"


def available_state_walks(interpret):
  """{implementation: (chunk_states, chunk_state_grads)} of the walks that run here: the
    Mosaic GPU ones on Hopper, or interpreted."""
  return {k: v for k, v in _STATE_WALKS.items() if k != "mosaic" or interpret or on_hopper()}


def state_walk_kinds(choice, dtypes, Dk, block_v, interpret):
  """(forward, backward) implementations of the state kernels for `choice`. The Mosaic
    GPU walk keeps the whole [Dk, BV] state in one warpgroup's registers: it needs q, k, v
    in one 16-bit dtype, Dk of 64 or 128 and 32-multiple value blocks. "auto" takes it for
    both walks where it fits, the choice that measured best end to end although the
    forward walk alone is not the faster one (docs/kernel_tuning.md, "KDA state walks")."""
  kind = choose_walk(choice, _STATE_WALKS, mosaic_fits(dtypes, Dk, block_v), interpret,
                     mosaic_requirement(dtypes, Dk, block_v))
  return kind, kind


def mosaic_fits(dtypes, Dk, block_v):
  """Whether the Mosaic GPU kernels (state walks, fused forward) take these inputs: the whole
    [Dk, BV] fp32 state in one warpgroup's registers."""
  return (sixteen_bit(dtypes) and Dk % 64 == 0 and Dk <= _kda_states_mosaic.MAX_DK and
          block_v % 32 == 0)


def mosaic_requirement(dtypes, Dk, block_v):
  """What mosaic_fits asks of the inputs, and what they are: the refusal's message."""
  return (f"q, k, v in one 16-bit dtype, Dk of 64 or 128 and a value block that "
          f"is a multiple of 32; got {[str(d) for d in dtypes]}, Dk = {Dk}, "
          f"block_v = {block_v}")


def _split_forward(v, b, beta, h0, masks, intra, scale, t, with_states):
  del beta, with_states  # the outputs kernel reads them: always in memory
  qg, kg, w, u0, aqk = intra[:5]
  cd = w.dtype
  h, vn, ht = _STATE_WALKS[t.state_walks[0]][0](w, u0, kg, b, masks[0], h0, block_v=t.block_v,
                                                cd=cd, interpret=t.interpret)
  o = chunk_output(qg, aqk, h, vn, scale=scale, out_dtype=v.dtype, block_v=t.block_v, cd=cd,
                   interpret=t.interpret)
  return (o, ht), h, vn


def _fused_forward(v, b, beta, h0, masks, intra, scale, t, with_states):
  qg, kg, w, u0, aqk = intra[:5]
  applied = None
  if _inverse_products(t, with_states) == "in_walk":
    kw, t_inv = w, u0  # the solve wrote T alone: intra holds kw and T where w and u0 are
    w, u0, applied = kw, v, (t_inv, beta)
  o, ht, *states = _kda_forward_mosaic.kda_forward(w, u0, kg, qg, aqk, b, masks[0], h0, scale=scale,
                                                   block_v=t.forward_block_v, out_dtype=v.dtype,
                                                   interpret=t.interpret, with_states=with_states,
                                                   applied=applied)
  return (o, ht), *(states if with_states else (None, None))


# Tiling.forward: "split" (state kernel, then the outputs kernel) or "fused" (one Mosaic
# GPU kernel walks the states and computes the outputs, writing the per-chunk states and
# v_new only for the backward)
_FORWARDS = {"split": _split_forward, "fused": _fused_forward}


def check_forward(forward, fits, interpret, requirement):
  """The forward's form: "fused" where asked and the Mosaic GPU state walk runs; "auto"
    takes it there, else "split"."""
  return choose_mosaic_or("forward", forward, _FORWARDS, "fused", "split", fits, interpret,
                          requirement)


def _summed_rows(t, for_backward):
  """The rows of b the first scores kernel writes: t.summed_rows where the fused forward
    alone reads no more than each chunk's last row after the scores, else every row."""
  alone = t.sums_decays and t.forward == "fused" and not for_backward
  return t.summed_rows if alone else "all"


def _products_for_tile(choice, forward_block_v, Dv):
  """inverse_products' "auto": in the walk where the fused forward's value tile is the
    whole head, where T and kw are read once a head and the walk's chain is not the bound
    (as jla's fused forward decides by its chains)."""
  if choice != "auto":
    return choice
  return "in_walk" if forward_block_v == Dv else "in_solve"


def _inverse_products(t, for_backward):
  """Where T's products are formed: t.inverse_products in the fused forward alone with the
    solve in its own kernel, else by the solve ("in_solve": the backward reads w)."""
  alone = t.forward == "fused" and not for_backward and t.solve == "own_kernel"
  return t.inverse_products if alone else "in_solve"


def _chunk_forward(q, k, v, b, beta, h0, runs, masks, scale, t, for_backward, layouts=None):
  """(q and k as the backward reads them, normalised where t.normalize; b, the in-chunk
    cumulative decay (summed from the log decays given as b where t.sums_decays); the
    in-chunk quantities; (o, final state); per-chunk states; v_new): the last two None where
    the fused forward is not asked for them (not for_backward), q and k too where
    normalised. layouts: every chunk's scores layout where the in-chunk sum gave them
    (chunk_intra's), else None."""
  intra = chunk_intra(q, k, v, b, beta, runs, *masks, cd=compute_dtype(q.dtype),
                      emit_inverse=for_backward, interpret=t.interpret, scores=t.scores,
                      normalize=t.normalize, solve=t.solve, from_gates=t.sums_decays,
                      operands=t.score_operands, inverse=t.inverse,
                      summed_rows=_summed_rows(t, for_backward),
                      inverse_products=_inverse_products(t, for_backward), layouts=layouts)
  if t.sums_decays:
    *intra, b = intra
  if t.normalize:
    *intra, q, k = intra if for_backward else (*intra, None, None)
  return q, k, b, intra, *_FORWARDS[t.forward](v, b, beta, h0, masks, intra, scale, t, for_backward)


def _normalize_vjp(x, dy):
  """The gradient of x through l2_normalize(x) (cast to x's dtype) for the cotangent dy."""
  return jax.vjp(l2_normalize, x)[1](dy.astype(jnp.float32))[0].astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10))
def _kda_core(q, k, v, b, beta, h0, runs, masks, layouts, scale, t):
  return _chunk_forward(q, k, v, b, beta, h0, runs, masks, scale, t, False, layouts)[4]


def _kda_core_fwd(q, k, v, b, beta, h0, runs, masks, layouts, scale, t):
  # The in-chunk kernel is the costliest of the forward (docs/kernel_tuning.md, "KDA
  # in-chunk results as residuals"), so its results are kept for the backward
  # (bf16, 1.8 KB per token and head at D = 128 with the chunk states) instead of
  # recomputed; tagged so that a remat policy keeping "attention" keeps them too.
  # With t.normalize the inputs q, k are kept too, for the normalisation's gradient; with
  # t.sums_decays, the log decays' dtype (a 0-d array) for their gradient's.
  qn, kn, bs, intra, out, h, vn = _chunk_forward(q, k, v, b, beta, h0, runs, masks, scale, t, True)
  qg, kg, w, _, aqk, inverse = intra
  qg, kg, w, aqk, inverse, h, vn = residuals.keep(qg, kg, w, aqk, inverse, h, vn)
  raw = (q, k) if t.normalize else ()
  decays = jnp.zeros((), b.dtype)
  return out, (qn, kn, v, bs, beta, runs, masks, qg, kg, w, aqk, inverse, h, vn, raw, decays)


def _kda_core_bwd(scale, t, res, cts):
  q, k, v, b, beta, runs, masks, qg, kg, w, aqk, inverse, h, vn, raw, decays = res
  do, dht = cts
  do = do.astype(v.dtype)
  cd = compute_dtype(q.dtype)
  kw = dict(block_v=t.block_v, cd=cd, interpret=t.interpret)
  dvl, dp = chunk_dv_local(aqk, do, vn, runs, scale=scale, **kw)
  dh, dvn, dh0 = _STATE_WALKS[t.state_walks[1]][1](qg, kg, w, b, masks[0], dvl, do, dht,
                                                   scale=scale, **kw)
  dv, dx, da, dbeta_v = chunk_wy_grads(inverse, dvn, vn, v, beta, runs, **kw)
  dq, dk, db, dbeta_k = chunk_key_grads(q, k, b, beta, *masks, h, dh, do, vn, dx, dp, da,
                                        scale=scale, block_k=t.block_k, form=t.key_grads, **kw)
  if raw:
    dq, dk = _normalize_vjp(raw[0], dq), _normalize_vjp(raw[1], dk)
  if t.sums_decays:  # the gradient of the log decays, through the first kernel's sum
    db = reverse_chunk_cumsum(db).astype(decays.dtype)
  return dq, dk, dv, db, dbeta_v + dbeta_k, dh0, None, None, None


_kda_core.defvjp(_kda_core_fwd, _kda_core_bwd)

# Where chunked_kda's L2 norm of q and k runs (qk_norm)
QK_NORMS = ("kernel", "xla")
# Where chunked_kda's in-chunk cumulative decay is summed (decay_sum)
DECAY_SUMS = ("own_kernel", "in_scores")


def chunked_kda(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
                output_final_state=False, normalize_qk=True, decay=None, block_v=None, block_k=None,
                state_walk="auto", forward="auto", scores="by_layout", key_grads="by_layout",
                qk_norm="kernel", solve="own_kernel", decay_sum="own_kernel",
                score_operands="compute", inverse="by_halves", summed_rows="chunk_ends",
                forward_block_v="by_heads", inverse_products="auto"):
  """Chunked KDA on Pallas kernels (interpreted on CPU). q, k, g: [B, T, H, Dk]; v:
    [B, T, H, Dv]; beta: [B, T, H]; g is the per-channel log decay (<= 0), or with
    decay (a decay_gate.DecayGate) the gate projection the decay is computed from, in the
    in-chunk cumulative sum's kernel. Returns
    (o [B, T, H, Dv] in v's dtype, fp32 final state [B, H, Dk, Dv] or None). block_v /
    block_k: the value-channel tile of every kernel / the key-channel tile of the
    key-gradient kernel (defaults by Dk, Dv). state_walk: the sequential kernels'
    implementation, "mosaic" (Hopper), "triton", or "auto" (state_walk_kinds). forward:
    "split" (state kernel, then outputs kernel), "fused" (both in one Mosaic GPU kernel:
    Hopper, or interpreted; where the Mosaic GPU walk fits) or "auto" ("fused" where it
    compiles, else "split"; docs/kernel_tuning.md, "KDA forward"). scores, key_grads: the
    in-chunk scores' and the key gradients' kernels, one of _chunk_factors.SCORE_KERNELS
    and of KEY_GRAD_KERNELS (by default one kernel per layout family for each; see the
    module's docstring). qk_norm: where normalize_qk's L2 norm runs, one of QK_NORMS:
    "kernel" (the default, the faster: docs/performance.md, "The L2 norm as row
    scales"), inside the first scores kernel, which scales its products by the inverse
    norms and writes the normalised q and k only where later kernels or the backward read
    them (with scores="by_layout", else as "xla"), or "xla", a
    plain-JAX pass before the kernels.
    solve: where T = (I + A_kk)^-1 and w, u0 are formed, one of SOLVES: "own_kernel"
    (the default), a kernel after the scores', or "in_scores", the HALVES chunks' in the
    scores' HALVES kernel, on A_kk in registers, the others' after (with
    scores="by_layout", else as "own_kernel"; within 3% of "own_kernel" either way:
    docs/performance.md, "Layouts from the chunk's end rows").
    decay_sum: where the in-chunk cumulative decay is summed, one of DECAY_SUMS:
    "own_kernel" (the default), a kernel before the others (_chunk_cumsum), or "in_scores",
    the first scores kernel on its way (one pass over the decays fewer; with scores
    "by_layout" and no `decay` gate, else as "own_kernel").
    summed_rows: with the decays summed in the first scores kernel and the fused forward,
    the rows of their sum that kernel writes in the forward alone, one of SUMMED_ROWS:
    "chunk_ends" (each chunk's last row, all the fused forward reads after the scores, and
    the rows of the chunks the later scores kernels take) or "all" (as the forward the
    backward follows writes them).
    score_operands: the operand dtype of the in-chunk score products (A_kk, A_qk) where the
    decays factor (WHOLE_CHUNK, HALVES chunks), one of SCORE_OPERANDS: "compute" (the
    default, the faster: docs/performance.md, "Score products on bf16 operands"), the
    compute dtype (bf16 for bf16 inputs), or "fp32" (TF32 on the GPU).
    inverse: how the solve's own kernel forms T = (I + A_kk)^-1, one of INVERSES:
    "by_halves" (the default, the faster: docs/kernel_tuning.md, "KDA in-chunk solve"),
    each 32-token half's inverse on its own, joined by the block below them (a quarter of
    the tensor-core work), or "whole_chunk", recursive doubling over the whole chunk.
    forward_block_v: the fused forward's value channels per program, a width or "by_heads"
    (the default: by the number of (batch row, head) chains, _mosaic_common.
    forward_value_tile; docs/kernel_tuning.md, "GLA and KDA fused forwards").
    inverse_products: where T's products w = T kw and u0 = T diag(beta) v are formed in
    the fused forward alone (with solve="own_kernel"; elsewhere by the solve), one of
    INVERSE_PRODUCTS: "in_solve", by the solve's own kernel, "in_walk", by the fused
    forward's walk, v_new = T (diag(beta) v - kw S) a chunk, the solve writing T alone, or
    "auto" (the default): "in_walk" where the fused forward's value tile is the whole head
    (T and kw read once a head), else "in_solve" (docs/kernel_tuning.md, "KDA in-chunk
    solve")."""
  B, T, H, Dk, Dv = validate(q, k, v, g, beta, initial_state, segment_ids, decay)
  check_head_dims(Dk, Dv)
  scale = default_scale(scale, Dk)
  asked = {
      "qk_norm": (qk_norm, QK_NORMS),
      "decay_sum": (decay_sum, DECAY_SUMS),
      "score_operands": (score_operands, SCORE_OPERANDS),
      "inverse": (inverse, INVERSES),
      "summed_rows": (summed_rows, SUMMED_ROWS),
      "inverse_products": (inverse_products, ("auto",) + INVERSE_PRODUCTS),
  }
  for name, (choice, known) in asked.items():
    if choice not in known:
      raise ValueError(f"{name} = {choice!r}: expected one of {list(known)}")
  in_kernel = normalize_qk and qk_norm == "kernel" and scores in FIRST_KERNEL_FORMS
  sums_decays = decay_sum == "in_scores" and scores in FIRST_KERNEL_FORMS and decay is None
  if normalize_qk and not in_kernel:  # plain JAX (autodiff), back to the input dtype
    q, k = l2_normalize(q).astype(q.dtype), l2_normalize(k).astype(k.dtype)
  # pad with tokens that change nothing: k = v = 0, g = 0, beta = 0 (run ids repeat)
  # every chunk's scores layout from the in-chunk sum, where the forward alone's scores
  # take them before their first kernel (else None: the kernels record their own)
  qp, kp, vp, b, runs, *layouts = _chunk_prep.prepare(
      q, k, v, g, segment_ids, B, T, decay, summed=not sums_decays,
      layouts=layouts_before_scores() and not sums_decays)
  layouts = layouts[0] if layouts else None
  beta = pad_time(beta.astype(jnp.float32), qp.shape[1])
  masks = _chunk_prep.segment_masks(runs)
  h0 = (jnp.zeros(
      (B, H, Dk, Dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32))
  # BV = 32 at Dk = 256 keeps the sequential kernels' [Dk, BV] fp32 state small
  bv = check_tile("block_v", block_v or min(Dv, 64 if Dk <= 128 else 32), "Dv", Dv)
  bk = check_tile("block_k", block_k or min(Dk, 64), "Dk", Dk)
  fbv = check_tile("forward_block_v", forward_value_tile(forward_block_v, B, H, Dv), "Dv", Dv)
  interpret = interpret_mode()
  dtypes = (q.dtype, k.dtype, v.dtype)
  walks = state_walk_kinds(state_walk, dtypes, Dk, bv, interpret)
  forward = check_forward(forward, mosaic_fits(dtypes, Dk, fbv), interpret,
                          mosaic_requirement(dtypes, Dk, fbv))
  for name, choice, known in (("scores", scores, SCORE_KERNELS),
                              ("key_grads", key_grads, KEY_GRAD_KERNELS), ("solve", solve, SOLVES)):
    if choice not in known:
      raise ValueError(f"{name} = {choice!r}: expected one of {list(known)}")
  t = Tiling(block_v=bv, block_k=bk, state_walks=walks, interpret=interpret, forward=forward,
             scores=scores, key_grads=key_grads, normalize=in_kernel, solve=solve,
             sums_decays=sums_decays, summed_rows=summed_rows, score_operands=score_operands,
             inverse=inverse, forward_block_v=fbv,
             inverse_products=_products_for_tile(inverse_products, fbv, Dv))
  o, ht = _kda_core(qp, kp, vp, b, beta, h0, runs, masks, layouts, float(scale), t)
  return o[:, :T], (ht if output_final_state else None)

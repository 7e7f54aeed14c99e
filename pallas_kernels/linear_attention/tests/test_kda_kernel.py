"""The Pallas KDA kernels (interpret mode on CPU) against the fp32 token-by-token oracle."""
import chex
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.linear_attention import _chunk_factors as factors
from pallas_kernels.linear_attention import _chunk_prep, _kda_scores
from pallas_kernels.linear_attention._chunk_cumsum import chunk_cumsum, chunk_cumsum_and_layouts
from pallas_kernels.linear_attention._kda_solve import INVERSES
from pallas_kernels.linear_attention import chunked_kda, kda_recurrent
from pallas_kernels.linear_attention.tests._data import (at_the_whole_chunk_limit, fast_jit,
                                                         make_inputs,
                                                         one_chunk_of_each_scores_layout,
                                                         outputs_and_grads, rel_rms, with_halves,
                                                         with_strong_decay, with_three_layouts)

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _errors(x, **kernel_kw):
  """Relative RMS errors of o, the final state and every gradient vs the fp32 oracle."""
  args = [x[n] for n in NAMES]
  f32 = [a.astype(jnp.float32) for a in args]
  oracle_kw = {k: v for k, v in kernel_kw.items() if k == "normalize_qk"}
  kw = dict(segment_ids=x["segment_ids"], output_final_state=True)
  (o_ref, s_ref), g_ref = outputs_and_grads(
      lambda *a: kda_recurrent(*a[:5], initial_state=a[5], **kw, **oracle_kw), *f32)
  (o, s), g_ker = outputs_and_grads(
      lambda *a: chunked_kda(*a[:5], initial_state=a[5], **kw, **kernel_kw), *args)
  chex.assert_equal_shape([o, o_ref])
  chex.assert_type([o, s], [x["v"].dtype, jnp.float32])
  errs = {"o": rel_rms(o_ref, o), "state": rel_rms(s_ref, s)}
  chex.assert_trees_all_equal_dtypes(g_ker, tuple(args))  # each gradient in its input's dtype
  for name, a, b in zip(NAMES, g_ref, g_ker):
    errs["d" + name] = rel_rms(a, b)
  return errs


def _assert_within(errs, out_tol, grad_tol):
  # "not <=": a NaN error is over any tolerance
  bad = {k: e for k, e in errs.items() if not e <= (grad_tol if k.startswith("d") else out_tol)}
  assert not bad, f"errors over tolerance: {bad} (all: {errs})"


@pytest.mark.parametrize("normalize_qk", [True, False])
def test_fp32_exact_with_resets_initial_state_strong_decay_padding_and_split_dv(normalize_qk):
  # T=130 pads to 192 (three chunks); Dv=32 in two blocks of 16; g down to -20
  x = make_inputs(seed=5, T=130, Dk=16, Dv=32, segment_rate=0.03)
  if not normalize_qk:  # the delta rule needs |k|^2 beta <= 2 to stay stable
    x["k"] = x["k"] / jnp.linalg.norm(x["k"], axis=-1, keepdims=True)
  _assert_within(_errors(x, block_v=16, normalize_qk=normalize_qk), 1e-4, 1e-4)


@pytest.mark.parametrize("qk_norm", ["kernel", "xla"])
def test_fp32_exact_at_the_whole_chunk_limit(qk_norm):
  """Every chunk factored through one anchor with factors up to exp(+-59), from q and k as
    given (the first scores kernel scales its products by their inverse norms) or
    normalised before; resets, an initial state and padding (T = 130)."""
  x = at_the_whole_chunk_limit(make_inputs(seed=41, T=130, Dk=16, Dv=32, segment_rate=0.03))
  _assert_within(_errors(x, block_v=16, qk_norm=qk_norm), 1e-4, 1e-4)


def test_fp32_exact_with_factored_and_exact_diagonal_blocks():
  # g >= -2 per token keeps a sub-chunk's decay range within 15 * 2 < FACTOR_LIMIT, so
  # chunks 0 and 2 take the matmul path; g = -20 on a few tokens of chunk 1 sends its
  # sub-chunks down the exact path, in the same kernel launch
  x = make_inputs(seed=9, T=130, Dk=16, Dv=32, min_log_decay=-2.0, segment_rate=0.03)
  t = jnp.arange(130)
  x = with_strong_decay(x, (t >= 70) & (t % 5 == 0) & (t < 128))
  _assert_within(_errors(x, block_v=16), 1e-4, 1e-4)


def test_fp32_exact_over_key_blocks_taking_different_diagonal_paths():
  # Dk = 32 in two key blocks of 16 for the key-gradient kernel; g = -20 on channels of
  # the second block only (a few tokens of chunk 1), so in the same sub-chunk one key
  # block factors its diagonal block and the other takes the exact path
  x = make_inputs(seed=13, T=150, Dk=32, Dv=16, min_log_decay=-2.0, segment_rate=0.03)
  t = jnp.arange(150)
  x = with_strong_decay(x, (t >= 70) & (t < 128) & (t % 5 == 0), jnp.arange(32) >= 16)
  _assert_within(_errors(x, block_k=16), 1e-4, 1e-4)


@pytest.mark.parametrize("dtype, out_tol, grad_tol", [(jnp.float32, 1e-4, 1e-4),
                                                      (jnp.bfloat16, 5e-3, 1e-2)])
def test_every_chunk_layout_in_one_launch(dtype, out_tol, grad_tol):
  # key blocks of 16: in chunk 1 one block is WHOLE_CHUNK, the other PER_SUB_CHUNK
  x = with_three_layouts(make_inputs(seed=16, T=192, Dk=32, Dv=32, dtype=dtype, segment_rate=0.03))
  _assert_within(_errors(x, block_k=16), out_tol, grad_tol)


@pytest.mark.parametrize("dtype, out_tol, grad_tol", [(jnp.float32, 1e-4, 1e-4),
                                                      (jnp.bfloat16, 5e-3, 1e-2)])
@pytest.mark.parametrize("scores", ["by_layout", "one_kernel"])
def test_scores_of_chunks_anchored_per_half_at_the_gate_bound(scores, dtype, out_tol, grad_tol):
  """Strong gates (down to -4.95 a token): the scores take HALVES, with factors up to
  exp(79), in either form of the scores' kernels."""
  x = with_halves(make_inputs(seed=19, T=192, Dk=32, Dv=32, dtype=dtype, segment_rate=0.03))
  _assert_within(_errors(x, scores=scores), out_tol, grad_tol)


@pytest.mark.parametrize("scores, qk_norm, across", [("by_layout", "xla", "own_exp"),
                                                     ("one_kernel", "xla", "own_exp"),
                                                     ("by_layout", "kernel", "own_exp"),
                                                     ("by_layout", "xla", "bridged")])
def test_halves_scores_over_channel_blocks(scores, qk_norm, across, monkeypatch):
  """The HALVES products summed over channel blocks (_kda_scores.HALVES_BLOCK_D; 64 of the
  released heads' 128, here 16 of 32) at the gate bound, fp32; by layout, over the rows
  the first kernel normalised too; the pairs across the halves in either form
  (_chunk_factors.HALVES_ACROSS_FORMS: bridged, their factors down to exp(-79))."""
  monkeypatch.setattr(_kda_scores, "HALVES_BLOCK_D", 16)
  monkeypatch.setattr(_kda_scores, "HALVES_ACROSS", across)
  x = with_halves(make_inputs(seed=23, T=192, Dk=32, Dv=32, segment_rate=0.03))
  _assert_within(_errors(x, scores=scores, qk_norm=qk_norm), 1e-4, 1e-4)


def test_qk_norm_as_row_scales_in_the_first_scores_kernel():
  """qk_norm="kernel": the first scores kernel scales its products and decayed rows by the
  inverse norms and writes the normalised rows for the later kernels and the backward. On
  unnormalised inputs (q, k x 3), one chunk of each layout: in fp32 the outputs and every
  gradient (through the normalisation's own gradient) as with the plain-JAX pass; in bf16
  as close to the fp32 oracle as the pass (it rounds the normalised rows to bf16 where the
  first kernel's chunks do not)."""
  errors = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    x = one_chunk_of_each_scores_layout(
        make_inputs(seed=21, T=192, Dk=32, Dv=32, dtype=dtype, segment_rate=0.03))
    x = dict(x, q=3.0 * x["q"], k=3.0 * x["k"])
    errors[dtype] = {norm: _errors(x, qk_norm=norm) for norm in ("kernel", "xla")}
  for name, err in errors[jnp.float32]["kernel"].items():
    assert err <= errors[jnp.float32]["xla"][name] + 1e-5, (name, errors[jnp.float32])
  _assert_within(errors[jnp.bfloat16]["kernel"], 5e-3, 1e-2)
  for name, err in errors[jnp.bfloat16]["kernel"].items():
    assert err <= 1.2 * errors[jnp.bfloat16]["xla"][name], (name, errors[jnp.bfloat16])


@pytest.mark.parametrize("qk_norm", ["kernel", "xla"])
def test_forward_alone_exact(qk_norm):
  """The forward alone, as inference runs it (no residuals: the first scores kernel writes
    the normalised rows for the later kernels' chunks alone, and no T), against the fp32
    oracle: unnormalised inputs (q, k x 3), one chunk of each scores layout, resets, an
    initial state."""
  x = one_chunk_of_each_scores_layout(make_inputs(seed=43, T=192, Dk=32, Dv=32, segment_rate=0.03))
  args = [3.0 * x["q"], 3.0 * x["k"]] + [x[n] for n in NAMES[2:]]
  kw = dict(segment_ids=x["segment_ids"], output_final_state=True)
  o_ref, s_ref = fast_jit(lambda *a: kda_recurrent(*a[:5], initial_state=a[5], **kw))(*args)
  o, s = fast_jit(lambda *a: chunked_kda(*a[:5], initial_state=a[5], qk_norm=qk_norm, **kw))(*args)
  errors = {"o": rel_rms(o_ref, o), "state": rel_rms(s_ref, s)}
  _assert_within(errors, 1e-4, 1e-4)


@pytest.mark.parametrize("form", ["by_layout", "one_kernel"])
def test_factored_score_products_in_the_compute_dtype(form):
  """score_operands="compute" (the default): the WHOLE_CHUNK and HALVES chunks' products on
  bf16 operands; bf16 inputs, one chunk of each scores layout. Against the fp32-operand
  products, A_kk and A_qk move in the factored chunks by about bf16's rounding, and not at
  all in the SUB_CHUNKS one; A_kk stays fp32; the op stays within the bf16 tolerances."""
  x = one_chunk_of_each_scores_layout(
      make_inputs(seed=29, T=192, Dk=32, Dv=32, dtype=jnp.bfloat16, segment_rate=0.03))
  B, T = x["q"].shape[:2]
  qp, kp, _, b, runs = _chunk_prep.prepare(x["q"], x["k"], x["v"], x["g"], x["segment_ids"], B, T)
  masks = _chunk_prep.segment_masks(runs)
  scores = {
      operands:
          _kda_scores.chunk_scores(qp, kp, b, x["beta"], runs, *masks, cd=jnp.bfloat16,
                                   interpret=True, form=form, operands=operands)[3:5]
      for operands in factors.SCORE_OPERANDS
  }
  chex.assert_type(scores["compute"], [jnp.float32, jnp.bfloat16])

  def moved(a, ref):  # per chunk [3], relative
    a, ref = a.astype(jnp.float32)[0], ref.astype(jnp.float32)[0]
    return jnp.sqrt(jnp.sum((a - ref)**2, (0, 2, 3)) / jnp.sum(ref**2, (0, 2, 3)))

  for compute, fp32 in zip(scores["compute"], scores["fp32"]):
    by_chunk = moved(compute, fp32)
    assert bool(jnp.all(by_chunk[:2] > 0)) and float(jnp.max(by_chunk)) < 1e-2, by_chunk
    assert float(by_chunk[2]) == 0.0, by_chunk
  _assert_within(_errors(x, scores=form, score_operands="compute"), 6e-3, 1.2e-2)


_HALVES_FIRST = "kda_chunk_scores_halves_first"


def test_halves_first_form(monkeypatch):
  """_kda_scores.HALVES_ROWS_IN_THEIR_KERNEL = "halves_first" (the default): in the forward
  alone the layouts from b in XLA (in the op: from the in-chunk sum, LAYOUTS_FROM_SUM), the
  HALVES kernel first, writing its chunks' qg, kg and kw and the SUB_CHUNKS chunks' rows
  too, the WHOLE_CHUNK and SUB_CHUNKS kernels after it. fp32, one chunk of each scores
  layout: qg, kg, kw, A_kk and A_qk as the first kernel's form's (the norms summed in
  blocks: within fp32 rounding); resets and padding: the forward alone exact against the
  oracle; an unknown form refused."""
  x = one_chunk_of_each_scores_layout(make_inputs(seed=33, T=192, Dk=32, Dv=32, segment_rate=0.03))
  B, T = x["q"].shape[:2]
  qp, kp, _, b, runs = _chunk_prep.prepare(3.0 * x["q"], 3.0 * x["k"], x["v"], x["g"],
                                           x["segment_ids"], B, T)
  masks = _chunk_prep.segment_masks(runs)
  monkeypatch.setattr(_kda_scores, "HALVES_BLOCK_D", 16)  # two channel blocks

  def scores(form):
    monkeypatch.setattr(_kda_scores, "HALVES_ROWS_IN_THEIR_KERNEL", form)

    def fn(q, k, b):
      return _kda_scores.chunk_scores(q, k, b, x["beta"], runs, *masks, cd=jnp.float32,
                                      interpret=True, form="by_layout", normalize=True,
                                      keep_normalized=False)[:5]

    assert (_HALVES_FIRST in str(jax.make_jaxpr(fn)(qp, kp, b))) == bool(form)
    return jax.jit(fn)(qp, kp, b)

  for a, ref in zip(scores("halves_first"), scores(False), strict=True):
    assert rel_rms(ref, a) <= 1e-6
  monkeypatch.setattr(_kda_scores, "HALVES_ROWS_IN_THEIR_KERNEL", "halves_first")
  # the layouts from the in-chunk sum (the scores above: from XLA)
  monkeypatch.setattr(_kda_scores, "LAYOUTS_FROM_SUM", True)
  args = [3.0 * x[n][:, :150] if n in "qk" else x[n][:, :150] for n in NAMES[:5]]
  kw = dict(initial_state=x["initial_state"], segment_ids=x["segment_ids"][:, :150],
            output_final_state=True)
  forward = lambda *a: chunked_kda(*a, **kw)
  jaxpr = str(jax.make_jaxpr(forward)(*args))
  assert _HALVES_FIRST in jaxpr and "chunk_cumsum_and_layouts" in jaxpr
  o_ref, s_ref = fast_jit(lambda *a: kda_recurrent(*a, **kw))(*args)
  o, s = fast_jit(forward)(*args)
  _assert_within({"o": rel_rms(o_ref, o), "state": rel_rms(s_ref, s)}, 1e-4, 1e-4)
  with pytest.raises(ValueError, match="HALVES_ROWS_IN_THEIR_KERNEL = 'sometimes'"):
    scores("sometimes")


def test_layout_flags_from_b_in_xla_and_the_sum_are_the_first_kernels():
  """_chunk_factors.score_layout_flags (plain JAX) and _chunk_cumsum.chunk_cumsum_and_layouts
  (from the rows the in-chunk sum holds), the HALVES-first form's layouts: the first scores
  kernel's flags to the bit, with one chunk of each scores layout and with strong decays
  (HALVES chunks on one head, SUB_CHUNKS on the other); the sum is chunk_cumsum's."""
  x = one_chunk_of_each_scores_layout(make_inputs(seed=51, T=192, H=2, Dk=32, Dv=32))
  B, T = x["q"].shape[:2]
  qp, kp, _, b, runs = _chunk_prep.prepare(x["q"], x["k"], x["v"], x["g"], x["segment_ids"], B, T)
  masks = _chunk_prep.segment_masks(runs)
  # about -3.1 and -5 a token: HALVES chunks on the first head, SUB_CHUNKS on the second
  shift = jnp.array([3.0, 5.0])[:, None]
  strong = -jax.nn.softplus(jax.random.normal(jax.random.key(3), b.shape) + shift)
  assert factors.score_layout_flags(chunk_cumsum(strong))[0, :, :, 0].tolist() == [[3] * 3, [2] * 3]
  for gates in (x["g"], strong):
    decays, layouts = chunk_cumsum_and_layouts(gates)
    chex.assert_trees_all_equal(decays, chunk_cumsum(gates))
    first_kernel = _kda_scores._first_pass(qp, kp, decays, x["beta"], runs, *masks, cd=jnp.float32,
                                           interpret=True, warps=4, normalize=True,
                                           keys_of_halves=True, operand=jnp.float32)[5]
    chex.assert_trees_all_equal(factors.score_layout_flags(decays), first_kernel)
    chex.assert_trees_all_equal(layouts, first_kernel)


@pytest.mark.parametrize("layouts", ["each", "whole_chunk"])
def test_whole_chunks_alone_where_every_chunk_is_whole_chunk(monkeypatch, layouts):
  """_kda_scores.WHOLE_CHUNKS_ALONE: in the HALVES-first form, where every chunk is
  WHOLE_CHUNK, the WHOLE_CHUNK chunks' kernel alone writes every output (no HALVES-first
  kernel launched), by a condition on the layouts: the forward alone's scores the same to
  the bit as without it, with every chunk WHOLE_CHUNK (that kernel alone) and with one
  chunk of each layout on each of two heads (the HALVES-first kernels); the op's forward
  alone against the oracle with it."""
  x = make_inputs(seed=53, T=192, H=2, Dk=32, Dv=32, segment_rate=0.03)
  if layouts == "each":
    x = one_chunk_of_each_scores_layout(x)
  else:
    x["g"] = -0.05 * jnp.abs(x["g"])
  B, T = x["q"].shape[:2]
  qp, kp, _, b, runs = _chunk_prep.prepare(3.0 * x["q"], 3.0 * x["k"], x["v"], x["g"],
                                           x["segment_ids"], B, T)
  masks = _chunk_prep.segment_masks(runs)
  every_whole = bool(jnp.all(factors.score_layout_flags(b) == factors.WHOLE_CHUNK))
  assert every_whole == (layouts == "whole_chunk")
  monkeypatch.setattr(_kda_scores, "HALVES_BLOCK_D", 16)

  def scores(alone):
    monkeypatch.setattr(_kda_scores, "WHOLE_CHUNKS_ALONE", alone)

    def fn(q, k, b):
      return _kda_scores.chunk_scores(q, k, b, x["beta"], runs, *masks, cd=jnp.float32,
                                      interpret=True, form="by_layout", normalize=True,
                                      keep_normalized=False)[:5]

    conds = [e for e in jax.make_jaxpr(fn)(qp, kp, b).eqns if e.primitive.name == "cond"]
    assert len(conds) == (1 if alone else 2)  # alone: the other two inside its second branch
    return jax.jit(fn)(qp, kp, b)

  chex.assert_trees_all_equal(scores(True), scores(False))
  monkeypatch.setattr(_kda_scores, "WHOLE_CHUNKS_ALONE", True)
  args = [3.0 * x[n] if n in "qk" else x[n] for n in NAMES[:5]]
  kw = dict(initial_state=x["initial_state"], segment_ids=x["segment_ids"], output_final_state=True)
  o_ref, s_ref = fast_jit(lambda *a: kda_recurrent(*a, **kw))(*args)
  o, s = fast_jit(lambda *a: chunked_kda(*a, **kw))(*args)
  _assert_within({"o": rel_rms(o_ref, o), "state": rel_rms(s_ref, s)}, 1e-4, 1e-4)


@pytest.mark.parametrize("layouts", ["each", "whole_chunk_alone"])
def test_later_passes_skipped_where_no_chunk_takes_their_layout(monkeypatch, layouts):
  """_kda_scores.SKIP_ABSENT_LAYOUTS: the HALVES and SUB_CHUNKS kernels each run under a
  condition on the layout flags, and the scores are the same to the bit as with both kernels
  run over every chunk: one chunk of each scores layout on each of two heads (both run), or
  every chunk WHOLE_CHUNK (neither has a chunk); the forward alone's scores and the
  training forward's. Then the op, forward and backward, against the oracle with it."""
  # the conditions counted here alone: not the forward alone's on every chunk WHOLE_CHUNK
  monkeypatch.setattr(_kda_scores, "WHOLE_CHUNKS_ALONE", False)
  x = make_inputs(seed=43, T=192, H=2, Dk=32, Dv=32, segment_rate=0.03)
  if layouts == "each":
    x = one_chunk_of_each_scores_layout(x)
  else:
    x["g"] = -0.05 * jnp.abs(x["g"])
  B, T = x["q"].shape[:2]
  qp, kp, _, b, runs = _chunk_prep.prepare(3.0 * x["q"], 3.0 * x["k"], x["v"], x["g"],
                                           x["segment_ids"], B, T)
  masks = _chunk_prep.segment_masks(runs)
  expected = jnp.array([0, 3, 2] if layouts == "each" else [0, 0, 0])
  assert jnp.all(factors.score_layouts(x["g"])[0] == expected[:,
                                                              None]), factors.score_layouts(x["g"])
  monkeypatch.setattr(_kda_scores, "HALVES_BLOCK_D", 16)

  def scores(skip, keep_normalized):
    monkeypatch.setattr(_kda_scores, "SKIP_ABSENT_LAYOUTS", skip)

    def fn(q, k, b):
      return _kda_scores.chunk_scores(q, k, b, x["beta"], runs, *masks, cd=jnp.float32,
                                      interpret=True, form="by_layout", normalize=True,
                                      keep_normalized=keep_normalized)

    conds = [e for e in jax.make_jaxpr(fn)(qp, kp, b).eqns if e.primitive.name == "cond"]
    assert len(conds) == (2 if skip else 0)
    return jax.jit(fn)(qp, kp, b)

  for keep_normalized in (False, True):
    for a, ref in zip(scores(True, keep_normalized), scores(False, keep_normalized), strict=True):
      chex.assert_trees_all_equal(a, ref)
  monkeypatch.setattr(_kda_scores, "SKIP_ABSENT_LAYOUTS", True)
  _assert_within(_errors(x), 1e-4, 1e-4)


@pytest.mark.parametrize("qk_norm, solve", [("xla", "own_kernel"), ("kernel", "own_kernel"),
                                            ("kernel", "in_scores")])
def test_decays_summed_in_the_first_scores_kernel(qk_norm, solve):
  """decay_sum="in_scores": the first scores kernel sums the log decays into b for itself,
  the later kernels and the backward, which hands the decays' gradient back through the
  sum's transpose; fp32, one chunk of each scores layout, resets and padding (T = 150), the
  norm in that kernel or not, the HALVES chunks solved in place or not."""
  x = one_chunk_of_each_scores_layout(make_inputs(seed=27, T=192, Dk=32, Dv=32, segment_rate=0.03))
  x = {n: a[:, :150] if n != "initial_state" else a for n, a in x.items()}
  _assert_within(_errors(x, qk_norm=qk_norm, solve=solve, decay_sum="in_scores"), 1e-4, 1e-4)


@pytest.mark.parametrize("layouts", ["three", "halves"])
def test_the_halves_chunks_solved_in_the_scores_kernel(layouts):
  """solve="in_scores": the scores' HALVES kernel solves its chunks in place, the solve's
  kernel the others after it (the default, solve="own_kernel", runs in every other test);
  over WHOLE_CHUNK and SUB_CHUNKS chunks (three) and HALVES ones at the gate bound (halves),
  with q and k normalised in the first scores kernel for the halves."""
  data = with_three_layouts if layouts == "three" else with_halves
  x = data(make_inputs(seed=24, T=192, Dk=32, Dv=32, segment_rate=0.03))
  qk_norm = "kernel" if layouts == "halves" else "xla"
  _assert_within(_errors(x, solve="in_scores", qk_norm=qk_norm), 1e-4, 1e-4)


@pytest.mark.parametrize("solve", ["own_kernel", "in_scores"])
@pytest.mark.parametrize("inverse", INVERSES)
def test_either_inverse_in_the_solve_kernel(inverse, solve):
  """The solve's own kernel inverts each 32-token half and joins them (inverse="by_halves",
  the default) or doubles over the whole chunk; fp32, resets and padding (T = 150), one
  chunk of each scores layout, all of them in the solve's kernel or the HALVES one in the
  scores' kernel (solve="in_scores", which doubles over the whole chunk either way); the
  outputs, the T the backward reads and every gradient exact. A name it does not know is
  refused."""
  x = one_chunk_of_each_scores_layout(make_inputs(seed=33, T=192, Dk=32, Dv=32, segment_rate=0.03))
  x = {n: a[:, :150] if n != "initial_state" else a for n, a in x.items()}
  _assert_within(_errors(x, inverse=inverse, solve=solve), 1e-4, 1e-4)
  with pytest.raises(ValueError, match=r"inverse = 'lu': expected one of"):
    chunked_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], inverse="lu")


@pytest.mark.parametrize("dtype, out_tol, grad_tol", [(jnp.float32, 1e-4, 1e-4),
                                                      (jnp.bfloat16, 5e-3, 1e-2)])
def test_key_gradients_in_one_kernel(dtype, out_tol, grad_tol):
  """key_grads="one_kernel" (one kernel branching per chunk) over every layout (and, in
  chunk 1, key blocks of different layouts); the default, by_layout, runs in every other
  test."""
  x = with_three_layouts(make_inputs(seed=18, T=192, Dk=32, Dv=32, dtype=dtype, segment_rate=0.03))
  _assert_within(_errors(x, block_k=16, key_grads="one_kernel"), out_tol, grad_tol)


def test_fp32_exact_at_the_widest_key_head():
  # Dk = 256 (its default value tile, 32): chunk 0 anchored once (whole-chunk products
  # over all 256 channels), chunk 1 once per sub-chunk
  x = make_inputs(seed=14, T=128, H=1, Dk=256, Dv=32, min_log_decay=-2.0, segment_rate=0.03)
  t = jnp.arange(128)
  x = with_strong_decay(x, (t >= 70) & (t % 5 == 0))
  assert factors.chunk_layouts(x["g"])[0, :,
                                       0].tolist() == [factors.WHOLE_CHUNK, factors.PER_SUB_CHUNK]
  _assert_within(_errors(x), 1e-4, 1e-4)


def test_bf16_inputs_within_tolerance():
  # B=2, D=64, strong decays (g down to -20), segment resets, initial state, T=130
  x = make_inputs(seed=7, B=2, T=130, H=2, Dk=64, Dv=64, dtype=jnp.bfloat16, segment_rate=0.02)
  _assert_within(_errors(x), 5e-3, 1e-2)


def test_bf16_single_segment_no_initial_state():
  x = make_inputs(seed=8, B=1, T=100, H=2, Dk=32, Dv=64, dtype=jnp.bfloat16, min_log_decay=-3.0,
                  segment_rate=0.0)
  args = [x[n] for n in NAMES[:5]]

  def grads_and_output(fn):
    """(gradients of sum(sin(o)), o) in one program; the final state is not asked for."""

    def loss(*a):
      o, s = fn(*a, segment_ids=None)
      assert s is None
      return jnp.sum(jnp.sin(o.astype(jnp.float32))), o

    return fast_jit(jax.grad(loss, range(5), has_aux=True))

  g_ref, o_ref = grads_and_output(kda_recurrent)(*(a.astype(jnp.float32) for a in args))
  g_ker, o = grads_and_output(chunked_kda)(*args)
  assert rel_rms(o_ref, o) < 5e-3
  for name, a, b in zip(NAMES, g_ref, g_ker):
    assert rel_rms(a, b) < 1e-2, name


@pytest.fixture(scope="module")
def small():
  return make_inputs(seed=0, T=8)


@pytest.mark.parametrize("name,bad,match", [
    ("k", jnp.zeros((1, 8, 2, 8)), "k has shape"),
    ("v", jnp.zeros((1, 7, 2, 16)), "v has shape"),
    ("g", jnp.zeros((1, 8, 16)), "g must be 4-D"),
    ("beta", jnp.zeros((1, 8, 3)), "beta has shape"),
    ("beta", jnp.zeros((1, 8)), "beta has shape"),
])
def test_bad_shapes(small, name, bad, match):
  args = {n: small[n] for n in NAMES[:5]}
  args[name] = bad
  with pytest.raises(ValueError, match=match):
    chunked_kda(*args.values())


def test_bad_keywords_and_head_dims(small):
  args = [small[n] for n in NAMES[:5]]
  with pytest.raises(ValueError, match="initial_state has shape"):
    chunked_kda(*args, initial_state=jnp.zeros((1, 2, 16, 8)))
  with pytest.raises(ValueError, match="segment_ids has shape"):
    chunked_kda(*args, segment_ids=jnp.zeros((1, 9), jnp.int32))
  q, k, v, g, beta = args
  with pytest.raises(ValueError, match="power of two"):
    chunked_kda(q[..., :12], k[..., :12], v, g[..., :12], beta)
  with pytest.raises(ValueError, match="block_v"):
    chunked_kda(*args, block_v=12)
  with pytest.raises(ValueError, match=r"scores = 'fused': expected one of \['one_kernel'"):
    chunked_kda(*args, scores="fused")
  with pytest.raises(ValueError, match=r"qk_norm = 'triton': expected one of \['kernel', 'xla'\]"):
    chunked_kda(*args, qk_norm="triton")
  with pytest.raises(ValueError, match=r"decay_sum = 'xla': expected one of \['own_kernel', "):
    chunked_kda(*args, decay_sum="xla")
  with pytest.raises(ValueError, match=r"key_grads = 'split': expected one of \['one_kernel'"):
    chunked_kda(*args, key_grads="split")
  with pytest.raises(ValueError, match=r"solve = 'fused': expected one of \['own_kernel'"):
    chunked_kda(*args, solve="fused")
  with pytest.raises(ValueError, match=r"summed_rows = 'last': expected one of \['all', "):
    chunked_kda(*args, summed_rows="last")

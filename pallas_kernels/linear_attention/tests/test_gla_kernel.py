"""The Pallas GLA kernels (interpret mode on CPU) against the fp32 token-by-token oracle."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear_attention import _chunk_factors as factors
from pallas_kernels.linear_attention import _chunk_prep, _gla_scores, chunked_gla, gla_recurrent
from pallas_kernels.linear_attention._gla_scores import chunk_scores
from pallas_kernels.linear_attention.gla import Tiling
from pallas_kernels.linear_attention.tests._data import (at_the_whole_chunk_limit, make_inputs,
                                                         outputs_and_grads, rel_rms, with_halves,
                                                         with_strong_decay, with_three_layouts)


def _check(x, out_tol, grad_tol, **kernel_kw):
  args = (x["q"], x["k"], x["v"], x["g"], x["initial_state"])
  f32 = [a.astype(jnp.float32) for a in args]
  kw = dict(segment_ids=x["segment_ids"], output_final_state=True)
  (o_ref, s_ref), grads_ref = outputs_and_grads(
      lambda q, k, v, g, h0: gla_recurrent(q, k, v, g, initial_state=h0, **kw), *f32)
  (o, s), grads = outputs_and_grads(
      lambda q, k, v, g, h0: chunked_gla(q, k, v, g, initial_state=h0, **kw, **kernel_kw), *args)
  chex.assert_type([o, s], [x["v"].dtype, jnp.float32])
  assert rel_rms(o_ref, o) < out_tol and rel_rms(s_ref, s) < out_tol
  for name, a, b in zip("q k v g h0".split(), grads_ref, grads):
    assert rel_rms(a, b) < grad_tol, name


def test_fp32_exact_with_resets_initial_state_strong_decay_and_split_dv():
  # T=80 pads to 128; 16-wide state tiles exercise the tiled sequential kernels
  _check(make_inputs(seed=5, T=80, Dk=32, Dv=32), 1e-4, 1e-4,
         tiling=Tiling(block_k=16, block_v=16, grad_block_v=16))


def _mixed_decay_inputs(seed, T=150, Dk=32, Dv=32, H=2):
  # g >= -2 per token keeps a sub-chunk's decay range within 15 * 2 < FACTOR_LIMIT, so
  # chunk 0 takes the matmul path; g = -20 on a few tokens of chunk 1 (all four of its
  # sub-chunks) and on channels 16.. only sends those sub-chunks down the exact path:
  # in key blocks of 16, one block factors while the other is exact. Chunks 0 and 2 are
  # bounded (whole-chunk matmuls, _chunk_factors), chunk 1 is not, but its first key
  # block of 16 is
  x = make_inputs(seed=seed, T=T, H=H, Dk=Dk, Dv=Dv, min_log_decay=-2.0)
  t = jnp.arange(T)
  return with_strong_decay(x, (t >= 66) & (t < 128) & (t % 4 == 0), jnp.arange(Dk) >= 16)


def test_fp32_exact_with_factored_and_exact_diagonal_blocks():
  _check(_mixed_decay_inputs(9), 1e-4, 1e-4)


@pytest.mark.parametrize("dtype, out_tol, grad_tol", [(jnp.float32, 1e-4, 1e-4),
                                                      (jnp.bfloat16, 5e-3, 1e-2)])
def test_every_chunk_layout_in_one_launch(dtype, out_tol, grad_tol):
  # key blocks of 16: in chunk 1 one block is WHOLE_CHUNK, the other PER_SUB_CHUNK
  x = with_three_layouts(make_inputs(seed=15, T=192, Dk=32, Dv=32, dtype=dtype))
  _check(x, out_tol, grad_tol, tiling=Tiling(block_k=16))


@pytest.mark.parametrize("dtype, out_tol, grad_tol", [(jnp.float32, 1e-4, 1e-4),
                                                      (jnp.bfloat16, 5e-3, 1e-2)])
def test_key_gradients_in_two_kernels_one_per_layout_family(dtype, out_tol, grad_tol):
  """Tiling(key_grads="by_layout"): the one-anchor chunks' kernel, then the others' into its
  outputs, over every layout (in chunk 1, key blocks of different layouts); a name it does
  not know is refused."""
  x = with_three_layouts(make_inputs(seed=19, T=192, Dk=32, Dv=32, dtype=dtype))
  _check(x, out_tol, grad_tol, tiling=Tiling(block_k=16, key_grads="by_layout"))
  with pytest.raises(ValueError, match=r"Tiling.key_grads = 'split': expected one of"):
    chunked_gla(x["q"], x["k"], x["v"], x["g"], tiling=Tiling(key_grads="split"))


@pytest.mark.parametrize("dtype, out_tol, grad_tol", [(jnp.float32, 1e-4, 1e-4),
                                                      (jnp.bfloat16, 5e-3, 1e-2)])
@pytest.mark.parametrize("scores", ["by_layout", "one_kernel"])
def test_scores_of_chunks_anchored_per_half_at_the_gate_bound(scores, dtype, out_tol, grad_tol):
  """Strong gates (down to -4.95 a token): the scores take HALVES, with factors up to
  exp(79), in either form of the scores' kernels."""
  x = with_halves(make_inputs(seed=20, T=192, Dk=32, Dv=32, dtype=dtype))
  _check(x, out_tol, grad_tol, tiling=Tiling(scores=scores))


@pytest.mark.parametrize("across", factors.HALVES_ACROSS_FORMS)
def test_halves_scores_over_channel_blocks_either_form_of_the_pairs_across(across, monkeypatch):
  """The HALVES products summed over channel blocks (_gla_scores.HALVES_BLOCK_D: 16 of 32
  here) at the gate bound, fp32, with the pairs across the halves in either form
  (_chunk_factors.HALVES_ACROSS_FORMS)."""
  monkeypatch.setattr(_gla_scores, "HALVES_BLOCK_D", 16)
  monkeypatch.setattr(_gla_scores, "HALVES_ACROSS", across)
  x = with_halves(make_inputs(seed=24, T=192, Dk=32, Dv=32))
  _check(x, 1e-4, 1e-4)


def _three_score_layouts(seed, D=32):
  """fp32 inputs (T = 192, Dk = Dv = D) whose scores take HALVES, WHOLE_CHUNK and
  SUB_CHUNKS, a chunk each: with_halves' first chunk, then mild gates, then g = -20 on every
  third token."""
  x = with_halves(make_inputs(seed=seed, T=192, Dk=D, Dv=D))
  t = jnp.arange(192)[None, :, None, None]
  mild = -jax.random.uniform(jax.random.key(seed), x["g"].shape)
  g = jnp.where(t < 64, x["g"], jnp.where(t < 128, mild, jnp.where(t % 3 == 0, -20.0, mild)))
  assert factors.score_layouts(g)[0, :, 0].tolist() == [
      factors.HALVES, factors.WHOLE_CHUNK, factors.SUB_CHUNKS
  ]
  return x | dict(g=g)


def test_scores_in_one_kernel_per_layout():
  """Tiling(scores="by_layout"): the WHOLE_CHUNK chunks' scores kernel, then the HALVES
  and the SUB_CHUNKS ones' into its output (the default, one kernel branching per chunk,
  runs in every other test); a name it does not know is refused."""
  x = _three_score_layouts(18)
  _check(x, 1e-4, 1e-4, tiling=Tiling(scores="by_layout"))
  with pytest.raises(ValueError, match=r"Tiling.scores = 'fused': expected one of \['one_kernel'"):
    chunked_gla(x["q"], x["k"], x["v"], x["g"], tiling=Tiling(scores="fused"))


@pytest.mark.parametrize("scores, forward", [("one_kernel", "split"), ("by_layout", "split"),
                                             ("one_kernel", "fused")])
def test_decays_summed_in_the_scores_kernel(scores, forward):
  """Tiling(decay_sum="in_scores"): the (first) scores kernel sums the log decays into b
  for itself, the later kernels, the forward's walk and the backward, which hands the
  decays' gradient back through the sum's transpose; both scores forms, one chunk of each
  layout, padding (T = 150), both forwards (the fused one over bf16 heads of 64)."""
  x = _three_score_layouts(29, D=64 if forward == "fused" else 32)
  x = {n: a[:, :150] if n != "initial_state" else a for n, a in x.items()}
  tiling = Tiling(scores=scores, forward=forward, decay_sum="in_scores")
  if forward == "fused":  # its Mosaic GPU kernels take 16-bit inputs
    x = {n: a.astype(jnp.bfloat16) if n in "qkv" else a for n, a in x.items()}
    _check(x, 5e-3, 1e-2, tiling=tiling._replace(state_walk="mosaic"))
  else:
    _check(x, 1e-4, 1e-4, tiling=tiling)
  with pytest.raises(ValueError, match=r"Tiling.decay_sum = 'xla': expected one of"):
    chunked_gla(x["q"], x["k"], x["v"], x["g"], tiling=Tiling(decay_sum="xla"))


@pytest.mark.parametrize("scores", ["one_kernel", "by_layout"])
def test_factored_score_products_in_the_compute_dtype(scores):
  """Tiling(score_operands="compute") (the default): the HALVES and WHOLE_CHUNK chunks'
  products on bf16 operands; bf16 inputs, one chunk of each scores layout. Against the
  fp32-operand products, A moves in the factored chunks by about bf16's rounding and not at
  all in the SUB_CHUNKS one; the op stays within the bf16 tolerances; a name it does not
  know is refused."""
  x = _three_score_layouts(31)
  x = {n: a.astype(jnp.bfloat16) if n in "qkv" else a for n, a in x.items()}
  B, T = x["q"].shape[:2]
  qp, kp, _, b, runs = _chunk_prep.prepare(x["q"], x["k"], x["v"], x["g"], x["segment_ids"], B, T)
  a = {
      operands:
          chunk_scores(qp, kp, b, runs, interpret=True, form=scores,
                       operands=operands).astype(jnp.float32)[0]
      for operands in factors.SCORE_OPERANDS
  }
  moved = jnp.sqrt(
      jnp.sum((a["compute"] - a["fp32"])**2, (0, 2, 3)) / jnp.sum(a["fp32"]**2, (0, 2, 3)))
  assert bool(jnp.all(moved[:2] > 0)) and float(jnp.max(moved)) < 1e-2, moved
  assert float(moved[2]) == 0.0, moved
  _check(x, 5e-3, 1e-2, tiling=Tiling(scores=scores, score_operands="compute"))
  with pytest.raises(ValueError, match=r"Tiling.score_operands = 'tf32': expected one of"):
    chunked_gla(x["q"], x["k"], x["v"], x["g"], tiling=Tiling(score_operands="tf32"))


def test_fp32_exact_at_the_whole_chunk_limit():
  """Every chunk factored through one anchor with factors up to exp(+-59); resets, an
    initial state and padding (T = 130)."""
  _check(at_the_whole_chunk_limit(make_inputs(seed=42, T=130, Dk=32, Dv=32)), 1e-4, 1e-4)


def test_fp32_exact_over_key_and_value_blocks():
  # two 16-channel blocks of keys and of values: every parallel kernel's block grid
  _check(_mixed_decay_inputs(10), 1e-4, 1e-4, tiling=Tiling(block_k=16, block_v=16,
                                                            grad_block_v=16))


@pytest.mark.parametrize("min_log_decay, bounded", [(-8.0, False), (-2.0, True)])
def test_bf16_inputs_within_tolerance(min_log_decay, bounded):
  # one chunk: one anchor per sub-chunk, the scores by halves (its widest channel decays by
  # 138 > 2 * WHOLE_LIMIT) or the whole-chunk matmuls (_chunk_factors)
  x = make_inputs(seed=6, T=64, H=1, Dk=16, Dv=16, dtype=jnp.bfloat16, min_log_decay=min_log_decay)
  assert bool((factors.chunk_layouts(x["g"]) == factors.WHOLE_CHUNK).all()) == bounded
  _check(x, 5e-3, 1e-2)


def test_fp32_exact_at_the_widest_key_head():
  # Dk = 256: chunk 0 anchored once (whole-chunk products over all 256 channels), chunk 1
  # once per sub-chunk
  x = _mixed_decay_inputs(12, T=128, Dk=256, Dv=32, H=1)
  assert factors.chunk_layouts(x["g"])[0, :,
                                       0].tolist() == [factors.WHOLE_CHUNK, factors.PER_SUB_CHUNK]
  _check(x, 1e-4, 1e-4)

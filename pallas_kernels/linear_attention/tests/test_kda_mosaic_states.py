"""The Mosaic GPU KDA kernels on CPU, under JAX's Mosaic GPU interpreter: the state walks
(_kda_states_mosaic) against the Triton walks on the same inputs (two value blocks,
segment resets inside and at a chunk's first token, an initial state), the fused forward
(_kda_forward_mosaic) against the walk and the outputs kernel, and chunked_kda through
them against the token-by-token oracle."""
import chex
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.linear_attention import (_chunk_prep, _kda_forward_mosaic, _kda_states,
                                             _kda_states_mosaic)
from pallas_kernels.linear_attention import chunked_kda, kda_recurrent
from pallas_kernels.linear_attention._kda_value_side import chunk_output
from pallas_kernels.linear_attention.tests._data import (make_inputs, mosaic_three_layouts,
                                                         one_chunk_of_each_scores_layout, rel_rms)
from pallas_kernels.linear_attention.tests.test_kda_kernel import _assert_within, _errors


def _rows(key, shape, scale=1.0):
  return (scale * jax.random.normal(key, shape)).astype(jnp.bfloat16)


def test_walks_match_the_triton_walks():
  B, T, H, Dk, Dv = 1, 192, 2, 64, 128  # whole chunks: the walks take padded inputs
  ks = jax.random.split(jax.random.key(31), 8)
  x = make_inputs(seed=31, T=T, H=H, Dk=Dk, Dv=Dv, min_log_decay=-8.0, segment_rate=0.02)
  x["segment_ids"] = x["segment_ids"].at[:, 128:].add(1)  # a reset on a chunk's first token
  # the walks' inputs as the in-chunk kernels would give them (w, kg, qg ~ k / 10)
  w, kg, qg = (_rows(k, (B, T, H, Dk), 0.1) for k in ks[:3])
  u0, dvl, do = (_rows(k, (B, T, H, Dv)) for k in ks[3:6])
  b, runs = _chunk_prep.prepare(w, kg, u0, x["g"], x["segment_ids"], B, T)[3:]
  carry_in, _ = _chunk_prep.segment_masks(runs)
  kw = dict(block_v=64, cd=jnp.bfloat16, interpret=True)
  ref = _kda_states.chunk_states(w, u0, kg, b, carry_in, x["initial_state"], **kw)
  out = _kda_states_mosaic.chunk_states(w, u0, kg, b, carry_in, x["initial_state"], **kw)
  # v_new = u0 - w S reads the bf16 state, so one-ulp differences of the stored states
  # (the Mosaic walk's fast exp) carry into v_new and back into the state
  chex.assert_trees_all_equal_dtypes(out, ref)
  for name, r, o in zip(("states", "v_new", "final"), ref, out):
    assert rel_rms(r, o) < 1e-3, name
  args = (qg, kg, w, b, carry_in, dvl, do, x["initial_state"])
  ref = _kda_states.chunk_state_grads(*args, scale=0.3, **kw)
  out = _kda_states_mosaic.chunk_state_grads(*args, scale=0.3, **kw)
  chex.assert_trees_all_equal_dtypes(out, ref)
  for name, r, o in zip(("state grads", "v_new grad", "initial-state grad"), ref, out):
    assert rel_rms(r, o) < 1e-3, name


def test_fused_forward_matches_the_walk_and_the_outputs_kernel():
  # the same in-chunk quantities through the Mosaic walk + the Triton outputs kernel and
  # through the fused kernel: 4 chunks, resets, an initial state, two value blocks
  B, T, H, Dk, Dv = 1, 256, 2, 64, 128
  ks = jax.random.split(jax.random.key(34), 6)
  x = make_inputs(seed=34, T=T, H=H, Dk=Dk, Dv=Dv, min_log_decay=-8.0, segment_rate=0.02)
  w, kg, qg = (_rows(k, (B, T, H, Dk), 0.1) for k in ks[:3])
  u0 = _rows(ks[3], (B, T, H, Dv))
  aqk = jnp.tril(_rows(ks[4], (B, H, T // 64, 64, 64), 0.1))
  b, runs = _chunk_prep.prepare(w, kg, u0, x["g"], x["segment_ids"], B, T)[3:]
  carry_in, _ = _chunk_prep.segment_masks(runs)
  kw = dict(block_v=64, interpret=True)
  h, vn, final = _kda_states_mosaic.chunk_states(w, u0, kg, b, carry_in, x["initial_state"],
                                                 cd=jnp.bfloat16, **kw)
  o = chunk_output(qg, aqk, h, vn, scale=0.3, out_dtype=jnp.bfloat16, cd=jnp.bfloat16, **kw)
  # the default tile with and without the states; 32- and 128-wide value tiles (four
  # programs per head, one) without
  for with_states, tile in ((False, 64), (True, 64), (False, 32), (False, 128)):
    out = _kda_forward_mosaic.kda_forward(w, u0, kg, qg, aqk, b, carry_in, x["initial_state"],
                                          scale=0.3, out_dtype=jnp.bfloat16,
                                          with_states=with_states, block_v=tile, interpret=True)
    want = (o, final, h, vn) if with_states else (o, final)
    chex.assert_trees_all_equal_shapes_and_dtypes(out, want)
    for name, r, got in zip(("o", "final", "states", "v_new"), want, out):
      assert rel_rms(r, got) < 1e-3, name


def test_chunked_kda_through_the_fused_forward_matches_the_oracle():
  _assert_within(_errors(mosaic_three_layouts(35), state_walk="mosaic", forward="fused"), 5e-3,
                 1e-2)


def test_chunked_kda_through_the_mosaic_walks_matches_the_oracle():
  _assert_within(_errors(mosaic_three_layouts(32), state_walk="mosaic"), 5e-3, 1e-2)


def test_mosaic_walk_refuses_what_it_cannot_take():
  x = make_inputs(seed=33, T=64, H=1, Dk=32, Dv=32, dtype=jnp.bfloat16)
  args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
  with pytest.raises(ValueError, match="Dk of 64 or 128"):
    chunked_kda(*args, state_walk="mosaic")
  with pytest.raises(ValueError, match="state_walk = 'cuda': expected"):
    chunked_kda(*args, state_walk="cuda")
  with pytest.raises(ValueError, match="forward = 'fused' needs q, k, v in one 16-bit dtype"):
    chunked_kda(*args, forward="fused")
  with pytest.raises(ValueError, match="forward = 'whole': expected 'auto' or one of"):
    chunked_kda(*args, forward="whole")


@pytest.mark.parametrize("solve", ["own_kernel", "in_scores"])
def test_fused_forward_alone_with_the_decays_summed_in_the_scores(solve):
  """The fused forward alone (no residuals) with the decays summed in the first scores
    kernel, which writes b's chunk-end rows alone (summed_rows="chunk_ends") or every row,
    against the fp32 oracle: one chunk of each scores layout (the later kernels read the
    HALVES and SUB_CHUNKS chunks' rows of b), resets, an initial state, q and k normalised
    in the kernel; with the HALVES chunks solved in the scores' kernel or not. The chunk
    ends give the very outputs and final state of every row."""
  x = one_chunk_of_each_scores_layout(
      make_inputs(seed=36, T=192, H=2, Dk=64, Dv=64, dtype=jnp.bfloat16, segment_rate=0.02))
  args = [x[n] for n in ("q", "k", "v", "g", "beta")]
  kw = dict(segment_ids=x["segment_ids"], output_final_state=True)
  o_ref, s_ref = kda_recurrent(*[a.astype(jnp.float32) for a in args],
                               initial_state=x["initial_state"], **kw)
  forward = lambda rows: jax.jit(lambda q, k, v, g, beta, h0: chunked_kda(
      q, k, v, g, beta, initial_state=h0, forward="fused", decay_sum="in_scores", solve=solve,
      summed_rows=rows, **kw))
  o, s = forward("chunk_ends")(*args, x["initial_state"])
  assert rel_rms(o_ref, o) < 5e-3 and rel_rms(s_ref, s) < 5e-3
  o_all, s_all = forward("all")(*args, x["initial_state"])
  assert rel_rms(o_all, o) == 0.0 and rel_rms(s_all, s) == 0.0


def test_fused_forward_alone_applying_the_inverse_in_the_walk():
  """inverse_products="in_walk": the solve writes T alone and the fused forward's walk forms
    v_new = T (diag(beta) v - kw S), against the fp32 oracle and against the solve's own
    products, in the forward alone: one chunk of each scores layout (strong decays in the
    HALVES and SUB_CHUNKS chunks), resets, an initial state, beta up to 1, two value tiles
    of 32 (T over the whole chunk) and one of 64 (T by halves); q and k normalised before
    the op, as the KDA layer's prologue does (normalize_qk=False: the walk does the same
    either way). With a gradient asked for, the forward keeps the solve's products (the
    backward reads w): the same outputs either way."""
  x = one_chunk_of_each_scores_layout(
      make_inputs(seed=37, T=192, H=2, Dk=64, Dv=64, dtype=jnp.bfloat16, segment_rate=0.02))
  for name in ("q", "k"):  # the delta rule needs |k|^2 beta <= 2 to stay stable
    x[name] = (x[name] /
               jnp.linalg.norm(x[name].astype(jnp.float32), axis=-1, keepdims=True)).astype(
                   x[name].dtype)
  args = [x[n] for n in ("q", "k", "v", "g", "beta")]
  kw = dict(segment_ids=x["segment_ids"], output_final_state=True, normalize_qk=False)
  o_ref, s_ref = kda_recurrent(*[a.astype(jnp.float32) for a in args],
                               initial_state=x["initial_state"], **kw)

  def forward(products, tile, inverse):
    return jax.jit(lambda q, k, v, g, beta, h0:
                   chunked_kda(q, k, v, g, beta, initial_state=h0, forward="fused", inverse_products
                               =products, forward_block_v=tile, inverse=inverse, **kw))

  # T by halves (the default) and over the whole chunk
  for tile, inverse in ((32, "whole_chunk"), (64, "by_halves")):
    o, s = forward("in_walk", tile, inverse)(*args, x["initial_state"])
    o_solve, s_solve = forward("in_solve", tile, inverse)(*args, x["initial_state"])
    assert rel_rms(o_ref, o) < 5e-3 and rel_rms(s_ref, s) < 5e-3, tile
    assert rel_rms(o_solve, o) < 5e-3 and rel_rms(s_solve, s) < 5e-3, tile
  loss = lambda products: jax.jit(
      jax.value_and_grad(lambda v: jnp.sum(
          chunked_kda(*args[:2], v, *args[3:], initial_state=x["initial_state"], forward="fused",
                      inverse_products=products, **kw)[0].astype(jnp.float32))))
  (l_walk, dv_walk), (l_solve, dv_solve) = loss("in_walk")(args[2]), loss("in_solve")(args[2])
  assert l_walk == l_solve and rel_rms(dv_solve, dv_walk) == 0.0


def test_the_inverse_in_the_walk_refuses_what_it_cannot_take():
  x = make_inputs(seed=38, T=64, H=1, Dk=64, Dv=64, dtype=jnp.bfloat16)
  args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
  with pytest.raises(ValueError,
                     match=r"inverse_products = 'walk': expected one of \['auto', 'in_solve'"):
    chunked_kda(*args, inverse_products="walk")


def test_the_inverse_goes_to_the_walk_where_the_tile_is_the_whole_head():
  from pallas_kernels.linear_attention.kda import _products_for_tile
  assert _products_for_tile("auto", 128, 128) == "in_walk"
  assert _products_for_tile("auto", 64, 128) == "in_solve"
  assert _products_for_tile("in_walk", 64, 128) == "in_walk"
  assert _products_for_tile("in_solve", 128, 128) == "in_solve"

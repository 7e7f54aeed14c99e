"""The Mosaic GPU kernels of chunked_gla on CPU, under JAX's Mosaic GPU interpreter (TMA
copies, barriers, warpgroup matmuls, two warpgroups): the state walks
(_gla_states_mosaic) against the Triton walks on the same inputs (2 x 2 state tiles,
segment resets inside and at chunk edges, an initial state), the fused forward
(_gla_forward_mosaic) against the split forward, and chunked_gla through them against
the token-by-token oracle."""
import chex
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.linear_attention import (_chunk_prep, _gla_scores, _gla_states,
                                             _gla_states_mosaic, _mosaic_common, gla, kda)
from pallas_kernels.linear_attention._mosaic_common import require_mosaic
from pallas_kernels.linear_attention.gla import Tiling, chunked_gla
from pallas_kernels.linear_attention.reference import gla_recurrent
from pallas_kernels.linear_attention.tests._data import (make_inputs, mosaic_three_layouts,
                                                         one_chunk_of_each_scores_layout, rel_rms)
from pallas_kernels.linear_attention.tests.test_gla_kernel import _check

D = 2 * _gla_states_mosaic.BLOCK


def test_walks_match_the_triton_walks():
  x = make_inputs(seed=21, T=200, H=2, Dk=D, Dv=D, dtype=jnp.bfloat16, min_log_decay=-8.0,
                  segment_rate=0.02)
  x["segment_ids"] = x["segment_ids"].at[:, 128:].add(1)  # a reset on a chunk's first token
  B, T = x["segment_ids"].shape
  q, k, v, b, runs = _chunk_prep.prepare(x["q"], x["k"], x["v"], x["g"], x["segment_ids"], B, T)
  carry_in, in_last = _chunk_prep.segment_masks(runs)
  h0, do = x["initial_state"], jax.random.normal(jax.random.key(3), v.shape, v.dtype)
  kw = dict(block_k=64, block_v=64, interpret=True)
  h_ref, final_ref = _gla_states.chunk_states(k, v, b, in_last, carry_in, h0, **kw)
  h, final = _gla_states_mosaic.chunk_states(k, v, b, in_last, carry_in, h0, interpret=True)
  chex.assert_type([h, final], [h_ref.dtype, jnp.float32])
  assert rel_rms(h_ref, h) < 1e-4 and rel_rms(final_ref, final) < 1e-5
  ds_ref, dh0_ref = _gla_states.chunk_state_grads(q, b, carry_in, do, h0, scale=0.3, **kw)
  ds, dh0 = _gla_states_mosaic.chunk_state_grads(q, b, carry_in, do, h0, scale=0.3, interpret=True)
  # the Mosaic walk rounds scale * q_dec to bf16 (the Triton one q_dec, then scales)
  assert rel_rms(ds_ref, ds) < 3e-3 and rel_rms(dh0_ref, dh0) < 3e-3


def test_chunked_gla_through_the_mosaic_walks_matches_the_oracle():
  _check(mosaic_three_layouts(22), 5e-3, 1e-2, tiling=Tiling(state_walk="mosaic"))


def test_mosaic_walk_refuses_what_it_cannot_take():
  x = make_inputs(seed=23, T=64, H=1, Dk=32, Dv=32, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="multiples of 64"):
    chunked_gla(x["q"], x["k"], x["v"], x["g"], tiling=Tiling(state_walk="mosaic"))
  with pytest.raises(ValueError, match="state_walk = .cuda.: expected"):
    chunked_gla(x["q"], x["k"], x["v"], x["g"], tiling=Tiling(state_walk="cuda"))
  with pytest.raises(ValueError, match="forward = 'fused' needs"):
    chunked_gla(x["q"], x["k"], x["v"], x["g"], tiling=Tiling(forward="fused"))
  with pytest.raises(ValueError, match="decayed_rows = 'triton': expected one of"):
    chunked_gla(x["q"], x["k"], x["v"], x["g"], tiling=Tiling(decayed_rows="triton"))
  with pytest.raises(ValueError, match="summed_rows = 'last': expected one of"):
    chunked_gla(x["q"], x["k"], x["v"], x["g"], tiling=Tiling(summed_rows="last"))
  # the chunk ends alone need the decays summed in the scores kernel, by its one-kernel form
  b, runs = _chunk_prep.prepare(x["q"], x["k"], x["v"], x["g"], None, 1, 64)[3:]
  with pytest.raises(ValueError, match="'chunk_ends' needs the decays summed in the scores"):
    _gla_scores.chunk_scores(x["q"], x["k"], b, runs, interpret=True, summed_rows="chunk_ends")
  with pytest.raises(ValueError, match="'chunk_ends' needs the one kernel's form; got 'by_layout'"):
    _gla_scores.chunk_scores(x["q"], x["k"], x["g"], runs, interpret=True, from_gates=True,
                             form="by_layout", summed_rows="chunk_ends")
  # compiled (not interpreted) anywhere but on Hopper: here, the CPU
  with pytest.raises(ValueError, match="runs on a Hopper GPU"):
    require_mosaic("state_walk = 'mosaic'", True, False, "")


def test_auto_forward_is_the_fused_one_where_it_compiles(monkeypatch):
  bf16, f32 = (jnp.bfloat16,) * 3, (jnp.float32,) * 3
  t = Tiling(forward_block_v=64)  # as chunked_gla resolves its default, "by_heads"
  # interpreted (CPU): the split forward, for GLA and KDA alike
  assert gla.check_forward(t._replace(interpret=True), bf16, 64, 64).forward == "split"
  assert kda.check_forward("auto", True, True, "") == "split"
  monkeypatch.setattr(_mosaic_common, "on_hopper", lambda: True)
  assert gla.check_forward(t, bf16, 64, 64).forward == "fused"
  assert kda.check_forward("auto", True, False, "") == "fused"
  # on Hopper, inputs the Mosaic GPU kernel does not take: the split forward
  assert gla.check_forward(t, f32, 64, 64).forward == "split"
  assert gla.check_forward(t, bf16, 32, 32).forward == "split"
  assert kda.check_forward("auto", False, False, "") == "split"
  # asked for by name, the split forward stays
  assert gla.check_forward(t._replace(forward="split"), bf16, 64, 64).forward == "split"


def test_fused_forward_matches_the_split_forward():
  # the fused forward (qg, kg from the scores kernel or from XLA + one two-warpgroup Mosaic
  # GPU kernel) against the split one on the same inputs: 4 chunks, resets, an initial
  # state; with the states it writes for the backward, as the split forward's state
  # kernel does
  x = make_inputs(seed=24, T=200, H=2, Dk=D, Dv=D, dtype=jnp.bfloat16, min_log_decay=-8.0,
                  segment_rate=0.02)
  B, T = x["segment_ids"].shape
  q, k, v, b, runs = _chunk_prep.prepare(x["q"], x["k"], x["v"], x["g"], x["segment_ids"], B, T)
  masks = _chunk_prep.segment_masks(runs)
  # the decays summed as prepare sums them (the scores kernel would take them as g)
  split = Tiling(state_walk="mosaic", forward="split", interpret=True, decay_sum="own_kernel",
                 forward_block_v=64)
  (o_ref, s_ref), a_ref, h_ref, _ = gla._forward(q, k, v, b, x["initial_state"], runs, masks, 0.3,
                                                 split)
  for decayed_rows, with_states in [("scores", False), ("scores", True), ("xla", True)]:
    fused = split._replace(forward="fused", decayed_rows=decayed_rows)
    (o, s), a, h, _ = gla._forward(q, k, v, b, x["initial_state"], runs, masks, 0.3, fused,
                                   with_states=with_states)
    assert o.dtype == o_ref.dtype and rel_rms(o_ref, o) < 1e-4 and rel_rms(s_ref, s) < 1e-5
    assert rel_rms(a_ref, a) == 0.0
    if with_states:
      chex.assert_type(h, h_ref.dtype)
      # the walk's 64-row tiles and the fused kernel's whole-Dk tile: same bf16 states
      assert rel_rms(h_ref, h) < 1e-5
    else:
      assert h is None


def test_chunked_gla_with_the_fused_forward_matches_the_oracle():
  _check(mosaic_three_layouts(25), 5e-3, 1e-2, tiling=Tiling(state_walk="mosaic", forward="fused"))


@pytest.mark.parametrize("summed_rows", ["chunk_ends", "all"])
def test_fused_forward_alone_matches_the_oracle(summed_rows):
  """The fused forward alone (no states for a backward, as inference and the benchmark's
    forward run it) with the decays summed in the scores kernel: writing b's chunk-end rows
    alone (the default) or every row, against the fp32 oracle. One chunk of each scores
    layout (the SUB_CHUNKS chunks read b's rows back, the HALVES ones sum their decays
    again), resets, an initial state; and the chunk ends match every row's forward
    exactly."""
  x = one_chunk_of_each_scores_layout(
      make_inputs(seed=26, T=192, H=2, Dk=D, Dv=D, dtype=jnp.bfloat16, segment_rate=0.02))
  args = (x["q"], x["k"], x["v"], x["g"], x["initial_state"])
  kw = dict(segment_ids=x["segment_ids"], output_final_state=True)
  o_ref, s_ref = gla_recurrent(*[a.astype(jnp.float32) for a in args[:4]], initial_state=args[4],
                               **kw)
  forward = lambda rows: jax.jit(lambda q, k, v, g, h0: chunked_gla(
      q, k, v, g, initial_state=h0, tiling=Tiling(forward="fused", summed_rows=rows), **kw))
  o, s = forward(summed_rows)(*args)
  assert rel_rms(o_ref, o) < 5e-3 and rel_rms(s_ref, s) < 5e-3
  if summed_rows == "chunk_ends":
    o_all, s_all = forward("all")(*args)
    assert rel_rms(o_all, o) == 0.0 and rel_rms(s_all, s) == 0.0


def test_fused_forward_value_tiles_give_the_64_wide_tiles_outputs():
  """The fused forward with 32- and 128-wide value tiles (four programs per head, one) and
    the default, by heads, gives the outputs and final state of a 64-wide tile: 2 chunks,
    resets, an initial state."""
  x = make_inputs(seed=27, T=128, H=1, Dk=D, Dv=D, dtype=jnp.bfloat16, min_log_decay=-8.0,
                  segment_rate=0.02)
  args = (x["q"], x["k"], x["v"], x["g"], x["initial_state"])
  kw = dict(segment_ids=x["segment_ids"], output_final_state=True)
  forward = lambda tile: jax.jit(lambda q, k, v, g, h0: chunked_gla(
      q, k, v, g, initial_state=h0, tiling=Tiling(forward="fused", forward_block_v=tile), **kw))
  o_ref, s_ref = forward(64)(*args)
  for tile in (32, 128, "by_heads"):
    o, s = forward(tile)(*args)
    assert rel_rms(o_ref, o) < 1e-6 and rel_rms(s_ref, s) < 1e-6, tile

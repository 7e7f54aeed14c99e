"""The Mosaic GPU KDA state walks (_kda_states_mosaic) on CPU, under JAX's Mosaic GPU
interpreter: against the Triton walks on the same inputs (two value blocks, segment
resets inside and at a chunk's first token, an initial state), and chunked_kda through
them against the token-by-token oracle."""
import chex
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.linear_attention import _chunk_prep, _kda_states, _kda_states_mosaic
from pallas_kernels.linear_attention import chunked_kda
from pallas_kernels.linear_attention.tests._data import make_inputs, rel_rms
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


def test_chunked_kda_through_the_mosaic_walks_matches_the_oracle():
  x = make_inputs(seed=32, T=100, H=1, Dk=64, Dv=64, dtype=jnp.bfloat16, min_log_decay=-5.0)
  _assert_within(_errors(x, state_walk="mosaic"), 5e-3, 1e-2)


def test_mosaic_walk_refuses_what_it_cannot_take():
  x = make_inputs(seed=33, T=64, H=1, Dk=32, Dv=32, dtype=jnp.bfloat16)
  args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
  with pytest.raises(ValueError, match="Dk of 64 or 128"):
    chunked_kda(*args, state_walk="mosaic")
  with pytest.raises(ValueError, match="state_walk = 'cuda': expected"):
    chunked_kda(*args, state_walk="cuda")

"""The KDA decay gate computed inside the in-chunk cumulative sum (interpret mode on CPU)
against its plain-JAX form: the kernel alone, and the KDA op with the gate against the
token-by-token oracle given the same gate."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear_attention import chunked_kda, kda_chunked, kda_recurrent
from pallas_kernels.linear_attention._chunk_cumsum import decay_cumsum
from pallas_kernels.linear_attention._inputs import CHUNK
from pallas_kernels.linear_attention.decay_gate import DecayGate
from pallas_kernels.linear_attention.tests._data import (fast_jit, make_inputs, outputs_and_grads,
                                                         rel_rms)

NAMES = ("q", "k", "v", "f", "beta", "initial_state", "a_log", "dt_bias")


def _gate_inputs(seed, B, T, H, D, dtype=jnp.float32, spread=3.0):
  """A gate projection f (spread N(0, 1)) and the released models' decay initialisation:
    per-token decays from ~0 to ~-30, far past what one anchor per sub-chunk factors."""
  kf, kp = jax.random.split(jax.random.key(seed))
  gate = DecayGate.drawn(kp, H, D)
  return (spread * jax.random.normal(kf, (B, T, H, D))).astype(dtype), gate.a_log, gate.dt_bias


@pytest.mark.parametrize("lower_bound", [0.0, -5.0])
def test_kernel_matches_the_formula_and_cumsum_forward_and_backward(lower_bound):
  # 100 tokens padded to 128: the padding decays by nothing; 128 channels in several
  # channel blocks each way (GATE_BLOCKS)
  B, T, H, D = 2, 100, 3, 128
  Tp = 2 * CHUNK
  f, a_log, dt_bias = _gate_inputs(1, B, Tp, H, D, jnp.bfloat16)
  w = jax.random.normal(jax.random.key(2), (B, Tp, H, D))

  def plain(f, a_log, dt_bias):
    g = DecayGate(a_log, dt_bias, lower_bound)(f)
    g = jnp.where(jnp.arange(Tp)[None, :, None, None] < T, g, 0.0)
    return jnp.cumsum(g.reshape(B, Tp // CHUNK, CHUNK, H, D), axis=2).reshape(g.shape)

  def fused(f, a_log, dt_bias):
    return decay_cumsum(f, DecayGate(a_log, dt_bias, lower_bound), T)

  def both(fn):
    return fast_jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * w), (0, 1, 2)))

  b_plain, b_fused = fast_jit(plain)(f, a_log, dt_bias), fast_jit(fused)(f, a_log, dt_bias)
  # decays near the bound, or past -20 a token without one
  strongest = float(DecayGate(a_log, dt_bias, lower_bound)(f).min())
  assert b_fused.dtype == jnp.float32 and strongest < (0.9 * lower_bound or -20.0)
  np.testing.assert_allclose(b_fused, b_plain, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(b_fused[:, T:],
                                jnp.broadcast_to(b_fused[:, T - 1:T], b_fused[:, T:].shape))
  (_, want), (_, got) = both(plain)(f, a_log, dt_bias), both(fused)(f, a_log, dt_bias)
  assert got[0].dtype == jnp.bfloat16
  for name, a, b in zip(("df", "da_log", "ddt_bias"), want, got):
    assert rel_rms(a, b) < (3e-3 if name == "df" else 1e-5), name  # df: one bf16 rounding


def _oracle_and_kernel(x, decay_of, **kernel_kw):
  """(o, final state) and the gradients of every input (the gate's parameters too) of the
    fp32 oracle and of chunked_kda, both given the gate."""
  kw = dict(segment_ids=x["segment_ids"], output_final_state=True)

  def call(fn, **extra):
    return lambda q, k, v, f, beta, h0, a_log, dt_bias: fn(q, k, v, f, beta, initial_state=h0, decay
                                                           =decay_of(a_log, dt_bias), **kw, **extra)

  args = [x[n] for n in NAMES]
  oracle = outputs_and_grads(call(kda_recurrent), *(a.astype(jnp.float32) for a in args))
  kernel = outputs_and_grads(call(chunked_kda, **kernel_kw), *args)
  return oracle, kernel


def test_kda_with_the_gate_matches_the_oracle_with_padding_resets_and_a_final_state():
  """K3's bounded form (both forms: the kernel test above)."""
  x = make_inputs(seed=3, T=130, H=2, Dk=16, Dv=32, segment_rate=0.03)  # pads to 192
  x["f"], x["a_log"], x["dt_bias"] = _gate_inputs(4, 1, 130, 2, 16)
  decay_of = lambda a_log, dt_bias: DecayGate(a_log, dt_bias, -5.0)
  ((o_ref, s_ref), g_ref), ((o, s), g_ker) = _oracle_and_kernel(x, decay_of, block_v=16)
  errs = {"o": rel_rms(o_ref, o), "state": rel_rms(s_ref, s)}
  errs.update({"d" + n: rel_rms(a, b) for n, a, b in zip(NAMES, g_ref, g_ker)})
  bad = {k: e for k, e in errs.items() if not e <= 1e-4}  # NaN included
  assert not bad, f"errors over 1e-4: {bad} (all: {errs})"


def test_the_chunked_reference_takes_the_gate_as_the_kernels_do():
  x = make_inputs(seed=6, T=70, H=2, Dk=16, Dv=16)
  f, a_log, dt_bias = _gate_inputs(7, 1, 70, 2, 16)
  decay = DecayGate(a_log, dt_bias, -5.0)
  args = (x["q"], x["k"], x["v"])
  kw = dict(beta=x["beta"], segment_ids=x["segment_ids"], output_final_state=True)
  with_gate = kda_chunked(*args, f, decay=decay, **kw)
  given_g = kda_chunked(*args, decay(f), **kw)
  for a, b in zip(with_gate, given_g):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("a_log_shape, dt_bias_shape, match", [
    ((3,), (2, 16), r"decay a_log has shape \(3,\), expected \(2,\)"),
    ((2,), (16,), r"decay dt_bias has shape \(16,\), expected \(2, 16\)"),
])
def test_a_gate_of_the_wrong_shape_is_one_line_naming_it(a_log_shape, dt_bias_shape, match):
  x = make_inputs(seed=0, T=64, H=2, Dk=16, Dv=16)
  decay = DecayGate(jnp.zeros(a_log_shape), jnp.zeros(dt_bias_shape))
  for op in (chunked_kda, kda_chunked, kda_recurrent):
    with pytest.raises(ValueError, match=match):
      op(x["q"], x["k"], x["v"], x["g"], x["beta"], decay=decay)
  with pytest.raises(ValueError, match="lower_bound = 1.0: must be < 0, or 0 for none"):
    DecayGate(jnp.zeros(2), jnp.zeros((2, 16)), 1.0)

"""The chunked plain-JAX forms against the token-by-token fp32 oracle."""
import jax
import pytest

from pallas_kernels.linear_attention import reference as R
from pallas_kernels.linear_attention.tests._data import fast_jit, loss_fn, make_inputs, rel_rms

CASES = {
    "gla": (R.gla_recurrent, R.gla_chunked, False),
    "kda": (R.kda_recurrent, R.kda_chunked, True)
}


@pytest.mark.parametrize("family", sorted(CASES))
def test_chunked_matches_recurrent_forward_and_grads(family):
  oracle, chunked, uses_beta = CASES[family]
  x = make_inputs(seed=11, B=1, T=80, H=2, Dk=16, Dv=32)  # T not a multiple of 64, resets, h0
  beta = (x["beta"],) if uses_beta else ()
  args = (x["q"], x["k"], x["v"], x["g"])
  kw = dict(initial_state=x["initial_state"], segment_ids=x["segment_ids"], output_final_state=True)
  o_ref, s_ref = fast_jit(lambda *a: oracle(*a, **kw))(*args, *beta)
  o, s = fast_jit(lambda *a: chunked(*a, **kw))(*args, *beta)
  assert rel_rms(o_ref, o) < 1e-5 and rel_rms(s_ref, s) < 1e-5
  argnums = (0, 1, 2, 3, 4, 5) if uses_beta else (0, 1, 2, 3, 4)
  grads_ref = fast_jit(jax.grad(loss_fn(oracle, x["segment_ids"]),
                                argnums))(*args, x["initial_state"], *beta)
  grads = fast_jit(jax.grad(loss_fn(chunked, x["segment_ids"]), argnums))(*args, x["initial_state"],
                                                                          *beta)
  for name, a, b in zip("q k v g h0 beta".split(), grads_ref, grads):
    assert rel_rms(a, b) < 1e-4, name


def test_segment_reset_forgets_previous_tokens():
  x = make_inputs(seed=3, T=70, segment_rate=0.0)
  seg = (jax.numpy.arange(70) >= 40).astype("int32")[None]
  o, _ = fast_jit(lambda *a: R.gla_chunked(*a, segment_ids=seg))(x["q"], x["k"], x["v"], x["g"])
  tail = slice(40, 70)
  o_alone, _ = fast_jit(R.gla_recurrent)(*(x[n][:, tail] for n in "qkvg"))
  assert rel_rms(o_alone, o[:, tail]) < 1e-5

"""Edge cases of the KDA kernels' 16-token sub-chunk structure, against the fp32 oracle."""
import jax.numpy as jnp

from pallas_kernels.linear_attention.tests._data import make_inputs
from pallas_kernels.linear_attention.tests.test_kda_kernel import _assert_within, _errors


def _segments(T, starts):
  """Segment ids that change at the given token positions."""
  return jnp.cumsum(jnp.isin(jnp.arange(T), jnp.array(starts)), dtype=jnp.int32)[None]


def test_resets_inside_sub_chunks_and_two_key_blocks():
  # resets mid sub-chunk (5, 21, 37), at a sub-chunk edge (48), at the chunk edge (64),
  # one token before a sub-chunk edge (79) and in the padded tail (T = 100 pads to 128);
  # Dk = 128 runs the key-gradient kernel on two channel blocks
  x = make_inputs(seed=21, T=100, H=1, Dk=128, Dv=16)
  x["segment_ids"] = _segments(100, [5, 21, 37, 48, 64, 79, 96])
  _assert_within(_errors(x), 1e-4, 1e-4)


def test_strongest_decay_on_half_the_channels_single_padded_chunk():
  # g = -20 (exp(g) ~ 2e-9) on every other channel of every token: those channels forget
  # within a token, every cross-token factor on them underflows and must stay finite
  # (exact zero-ish gradients there; the mild channels carry the decay gradient)
  x = make_inputs(seed=22, T=40, H=1, Dk=32, Dv=16, segment_rate=0.0)
  strong = jnp.arange(32) % 2 == 0
  x["g"] = jnp.where(strong, -20.0, -0.1 * jnp.abs(x["g"]) - 1e-3)
  errs = _errors(x)
  assert all(jnp.isfinite(e) for e in errs.values()), errs
  _assert_within(errs, 1e-4, 1e-4)

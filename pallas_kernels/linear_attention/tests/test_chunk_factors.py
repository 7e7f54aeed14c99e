"""The in-chunk decay factoring: which chunks take which layout, and that it is exact."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear_attention import _chunk_factors as factors
from pallas_kernels.linear_attention._diagonal_blocks import FACTOR_LIMIT
from pallas_kernels.linear_attention._inputs import CHUNK
from pallas_kernels.linear_attention._pallas_common import N_SUB, SUB


def _chunk_decays(span, seed=0, n=CHUNK):
  """b [n, 8]: cumulative log decays whose widest channel falls by exactly `span`."""
  g = -jax.random.uniform(jax.random.key(seed), (n, 8))
  b = jnp.cumsum(g, axis=0)
  return b * (span / (b[0] - b[-1]).max())


def test_bounded_up_to_twice_the_limit_of_the_span():
  """A chunk factors through one anchor up to 2 * WHOLE_LIMIT, a sub-chunk through its own
    up to 2 * FACTOR_LIMIT."""
  for span, bounded in ((2 * factors.WHOLE_LIMIT - 0.5, True), (2 * factors.WHOLE_LIMIT + 0.5,
                                                                False)):
    b = _chunk_decays(span)
    m, ok = factors.midpoint(b)
    assert bool(ok) == bounded, span
    # the end rows bound the falling b: every row's reductions give the same
    m_rows, ok_rows = factors.rows_midpoint(b)
    assert bool(ok_rows) == bounded, span
    np.testing.assert_allclose(m_rows, m, rtol=1e-6)
    # every factor's exponent is within half the widest channel's range
    assert float(jnp.abs(b - m).max()) <= span / 2 + 1e-4
  assert FACTOR_LIMIT < factors.WHOLE_LIMIT
  for span, bounded in ((2 * FACTOR_LIMIT - 0.5, True), (2 * FACTOR_LIMIT + 0.5, False)):
    # each sub-chunk falls by `span`, from where the one before ends
    b = jnp.concatenate([_chunk_decays(span, seed=j, n=SUB) - 2 * span * j for j in range(N_SUB)])
    for j in range(N_SUB):
      assert bool(factors.midpoint(b, j * SUB, SUB)[1]) == bounded, (span, j)
      assert bool(factors.rows_midpoint(b[j * SUB:(j + 1) * SUB])[1]) == bounded, (span, j)


def test_factors_multiply_to_the_decay_between_any_two_tokens():
  b = _chunk_decays(2 * factors.WHOLE_LIMIT - 1.0, seed=1)
  m, _ = factors.midpoint(b)
  down, up = factors.factors(b, m)
  pairs = down[:, None, :] * up[None, :, :]  # [t, s, d]
  exact = jnp.exp(b[:, None, :] - b[None, :, :])
  t, s = np.tril_indices(CHUNK)
  np.testing.assert_allclose(pairs[t, s], exact[t, s], rtol=2e-5, atol=1e-30)


def _sub_chunk_anchors(b):
  rows = tuple(factors.midpoint(b, j * SUB, SUB)[0] for j in range(N_SUB))
  return factors.Anchors(rows, jnp.asarray(False))


@pytest.mark.parametrize("gap", [None, -12.0])
def test_per_sub_chunk_anchors_and_bridges_give_the_decay_of_every_causal_pair(gap):
  # about -5 a token: the chunk decays by ~320 (one anchor would need exp(+-160)), each
  # sub-chunk by ~77 (its own anchor keeps every factor within exp(+-39)). gap: the first
  # token of every sub-chunk decays by that much, which puts consecutive anchors ~89
  # apart: a bridge exp(m_I - m_J) alone would flush to zero pairs that decay by e^-12
  g = -4.9 - 0.3 * jax.random.uniform(jax.random.key(2), (CHUNK, 8))
  if gap is not None:
    g = jnp.where((jnp.arange(CHUNK) % SUB == 0)[:, None], gap, g)
  b = jnp.cumsum(g, axis=0)
  anchors = _sub_chunk_anchors(b)
  down, up = factors.factors(b, anchors.per_token())
  assert float(jnp.abs(jnp.log(down)).max()) <= FACTOR_LIMIT
  exact = jnp.exp(b[:, None, :] - b[None, :, :])  # [t, s, d]
  t, s = np.tril_indices(CHUNK)
  for i in range(N_SUB):
    mine = slice(i * SUB, (i + 1) * SUB)
    down_i, up_i = anchors.step_factors(b[mine], i)
    bound = np.exp(FACTOR_LIMIT - factors.BRIDGE_SHIFT)
    assert float(down_i.max()) <= bound and float(up_i.max()) <= bound
    # sub-chunk i's queries against bridged keys, its keys against bridged queries
    as_query = down_i[:, None, :] * anchors.bridge(up, i, keys=True)[None, :, :]
    as_key = anchors.bridge(down, i, keys=False)[:, None, :] * up_i[None, :, :]
    for pairs, rows, cols in ((as_query, t - i * SUB, s), (as_key, t, s - i * SUB)):
      keep = (rows >= 0) & (rows < SUB) & (cols >= 0) & (cols < SUB)
      got = pairs[rows[keep], cols[keep]]
      want = exact[t[keep], s[keep]]
      # a flushed bridge drops only pairs below exp(2 FACTOR_LIMIT - BRIDGE_SHIFT - 87)
      np.testing.assert_allclose(got, want, rtol=5e-5, atol=2e-12)
      assert bool(jnp.isfinite(pairs).all())


def test_uniform_anchors_leave_the_operands_as_they_are():
  b = _chunk_decays(2 * factors.WHOLE_LIMIT - 1.0, seed=3)
  m, _ = factors.midpoint(b)
  anchors = factors.Anchors((m,) * N_SUB, jnp.asarray(True))
  x = jax.random.normal(jax.random.key(4), b.shape)
  for i in range(N_SUB):
    assert (anchors.bridge(x, i, keys=True) == x).all()


def test_layouts_switch_at_twice_the_limits():
  """WHOLE_CHUNK up to 2 * WHOLE_LIMIT over the chunk, PER_SUB_CHUNK up to 2 * FACTOR_LIMIT
    over every sub-chunk, SUB_CHUNKS past it (one channel of one sub-chunk is enough)."""
  whole, limit = 2 * factors.WHOLE_LIMIT, 2 * FACTOR_LIMIT

  def layout(g):
    return int(factors.chunk_layouts(g)[0, 0, 0])

  for scale, expected in ((0.99, factors.WHOLE_CHUNK), (1.01, factors.PER_SUB_CHUNK)):
    assert layout(jnp.full((1, CHUNK, 1, 4), -whole / (CHUNK - 1) * scale)) == expected, scale

  def gates(per_token_in_sub_chunk_3):
    g = jnp.full((1, CHUNK, 1, 4), -limit / CHUNK * 0.9)
    return g.at[0, 3 * SUB + 1:, 0, 2].set(per_token_in_sub_chunk_3)

  expect = [((limit - 0.5) / (SUB - 1), factors.PER_SUB_CHUNK),
            ((limit + 0.5) / (SUB - 1), factors.SUB_CHUNKS)]
  for g_3, expected in expect:
    assert layout(gates(-g_3)) == expected, g_3


def test_score_layouts_take_halves_up_to_the_half_limit_from_each_anchor():
  """The scores' layouts: WHOLE_CHUNK up to 2 * WHOLE_LIMIT over the chunk, HALVES while
    every token is within HALF_LIMIT of its half's anchor (its 16th token), SUB_CHUNKS past
    it: one channel's 16 tokens after the second half's anchor are enough."""

  def gates(per_token_after_anchor):
    g = jnp.full((1, CHUNK, 1, 4), -2.0)  # 126 over the chunk: not WHOLE_CHUNK
    assert 2 * factors.WHOLE_LIMIT < 126
    return g.at[0, factors.HALF + factors.HALF_ANCHOR + 1:, 0, 1].set(per_token_after_anchor)

  tokens = CHUNK - factors.HALF - factors.HALF_ANCHOR - 1
  assert tokens == 16
  expect = [((factors.HALF_LIMIT - 0.5) / tokens, factors.HALVES),
            ((factors.HALF_LIMIT + 0.5) / tokens, factors.SUB_CHUNKS)]
  for g_after, layout in expect:
    assert int(factors.score_layouts(gates(-g_after))[0, 0, 0]) == layout, g_after
  mild = jnp.full((1, CHUNK, 1, 4), -2 * factors.WHOLE_LIMIT / CHUNK * 0.9)
  assert int(factors.score_layouts(mild)[0, 0, 0]) == factors.WHOLE_CHUNK
  # the pairs across re-anchor at the first half's last token: one strong gate on the second
  # half's first token, every token near its own anchor, and the second anchor 0.5 inside
  # (or past) HALF_LIMIT from that token
  after_boundary = 2.0 * factors.HALF_ANCHOR  # tokens HALF + 1 .. the anchor, at -2 each
  for over, layout in ((-0.5, factors.HALVES), (0.5, factors.SUB_CHUNKS)):
    g = jnp.full((1, CHUNK, 1, 4), -2.0).at[0, factors.HALF, 0,
                                            1].set(-(factors.HALF_LIMIT + over - after_boundary))
    assert int(factors.score_layouts(g)[0, 0, 0]) == layout, over


def test_layouts_from_the_end_rows_are_the_layouts_of_every_token():
  """The kernels' layout tests (midpoint and halves_bounded: six rows of b; rows_midpoint and
    halves_bounded_rows: the rows in registers) give score_layouts' layout (every token) for
    decays that fall, chunk by chunk, on both sides of each limit."""
  from jax.experimental import pallas as pl

  def from_ends(g):
    b = jnp.cumsum(g[0, :, 0].astype(jnp.float32), axis=0)  # [C, D]

    def kernel(b_ref, out_ref):
      layout = jnp.where(
          factors.midpoint(b_ref)[1], factors.WHOLE_CHUNK,
          jnp.where(factors.halves_bounded(b_ref), factors.HALVES, factors.SUB_CHUNKS))
      rows = b_ref[...]
      from_rows = jnp.where(
          factors.rows_midpoint(rows)[1], factors.WHOLE_CHUNK,
          jnp.where(factors.halves_bounded_rows(rows), factors.HALVES, factors.SUB_CHUNKS))
      out_ref[...] = jnp.stack([layout, from_rows]).astype(jnp.int32)

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((2,), jnp.int32), interpret=True)(b)
    assert int(out[0]) == int(out[1])
    return int(out[0])

  half, anchor = factors.HALF, factors.HALF_ANCHOR
  cases = []
  for scale in (0.9, 1.1):  # around WHOLE_CHUNK's limit, mild in every half
    cases.append(jnp.full((1, CHUNK, 1, 4), -2 * factors.WHOLE_LIMIT / (CHUNK - 1) * scale))
  # channel 0 at -2 a token (126 over the chunk: not WHOLE_CHUNK, well inside HALVES)
  assert 2 * factors.WHOLE_LIMIT < 126
  not_whole = jnp.zeros((1, CHUNK, 1, 4)).at[0, :, 0, 0].set(-2.0)
  # each of the four gaps to an anchor past HALF_LIMIT, and the gap from the first half's
  # last token to the second half's anchor
  for start, stop in ((1, anchor + 1), (anchor + 1, half), (half + 1, half + anchor + 1),
                      (half + anchor + 1, CHUNK), (half, half + anchor + 1)):
    for over in (-0.5, 0.5):
      g = not_whole.at[0, start:stop, 0, 2].set(-(factors.HALF_LIMIT + over) / (stop - start))
      cases.append(g)
  key = jax.random.key(5)
  for mean in (0.0, -3.0, -6.0):  # random gates in the three regimes
    key, sub = jax.random.split(key)
    cases.append(jax.nn.log_sigmoid(mean + jax.random.normal(sub, (1, CHUNK, 1, 16))))
  seen = set()
  for g in cases:
    expected = int(factors.score_layouts(g)[0, 0, 0])
    assert from_ends(g) == expected
    seen.add(expected)
  assert seen == {factors.WHOLE_CHUNK, factors.HALVES, factors.SUB_CHUNKS}


def test_recorded_layout_codes_lower_for_hopper_as_int32():
  """record_layout's codes reach the compiled kernel as int32 constants (HALVES = 3,
    SUB_CHUNKS = 2). With Python-int literals the Triton lowering typed them as the
    predicate, i1, and the flags read 1 or 0: the per-layout scores kernels then skipped
    every chunk that was not WHOLE_CHUNK on the GPU (exact only when interpreted)."""
  from jax.experimental import pallas as pl

  from experiments import kernel_resources as kr

  def kernel(b_ref, flag_ref):
    factors.record_layout(flag_ref, b_ref)

  kernels = []
  b = jax.ShapeDtypeStruct((CHUNK, 16), jnp.float32)
  with kr._lowering_for_cuda(kernels):
    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((CHUNK,), jnp.int32),
                          name="record_layout")
    jax.jit(call).trace(b).lower(lowering_platforms=("cuda",))
  (ttir,) = [k.ttir for k in kernels]
  for code in (factors.HALVES, factors.SUB_CHUNKS):
    assert f"arith.constant {code} : i32" in ttir, code

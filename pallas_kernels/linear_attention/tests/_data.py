"""Fresh random inputs for the linear-attention tests."""
import jax
import jax.numpy as jnp

from pallas_kernels.linear_attention import _chunk_factors as factors
from pallas_kernels.linear_attention import _diagonal_blocks as diag
from pallas_kernels.linear_attention._inputs import CHUNK
from pallas_kernels.linear_attention._pallas_common import SUB


def make_inputs(seed, B=1, T=80, H=2, Dk=16, Dv=16, dtype=jnp.float32, min_log_decay=-20.0,
                segment_rate=0.04):
  ks = jax.random.split(jax.random.key(seed), 8)
  q = jax.random.normal(ks[0], (B, T, H, Dk)).astype(dtype)
  k = jax.random.normal(ks[1], (B, T, H, Dk)).astype(dtype)
  v = jax.random.normal(ks[2], (B, T, H, Dv)).astype(dtype)
  # mostly mild decays with a heavy tail down to min_log_decay
  g = min_log_decay * jax.random.uniform(ks[3], (B, T, H, Dk))**4
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
  segment_ids = jnp.cumsum(jax.random.uniform(ks[5], (B, T)) < segment_rate,
                           axis=1).astype(jnp.int32)
  h0 = jax.random.normal(ks[6], (B, H, Dk, Dv))
  return dict(q=q, k=k, v=v, g=g, beta=beta, segment_ids=segment_ids, initial_state=h0)


def with_strong_decay(x, tokens, channels=None, log_decay=-20.0):
  """x with g = log_decay on the tokens (bool [T]) and channels (bool [Dk], all if None).
    On inputs made with min_log_decay >= -2, a 16-token sub-chunk stays within the
    factored diagonal path's decay range (15 * 2 < FACTOR_LIMIT) unless it holds such
    tokens: three of them (3 * 20 > FACTOR_LIMIT) send it down the exact path."""
  assert 15 * 2.0 < diag.FACTOR_LIMIT < 3 * -log_decay
  mask = tokens[:, None] if channels is None else tokens[:, None] & channels[None, :]
  return dict(x, g=jnp.where(mask[None, :, None, :], log_decay, x["g"]))


def with_three_layouts(x, seed=0):
  """x (T = 192) with chunk 0 in WHOLE_CHUNK (g in [-1, 0]); chunk 1 in PER_SUB_CHUNK on the
    upper half of the channels (g in [-5, -4.7], -12 on the first token of each sub-chunk:
    each decays by up to 75 of the 80 the layout allows, one anchor for the chunk would
    need exp(+-175)) and WHOLE_CHUNK on the lower half (mild: a key block of those
    channels takes it); chunk 2 in SUB_CHUNKS (mild but g = -20 on every third token). The
    scores take chunk 1 by sub-chunks too: its halves decay past HALF_LIMIT (with_halves)."""
  B, T, H, D = x["g"].shape
  assert T == 3 * CHUNK
  u = jax.random.uniform(jax.random.key(seed), x["g"].shape)
  t = jnp.arange(T)[None, :, None, None]
  upper = (jnp.arange(D) >= D // 2)[None, None, None, :]
  # anchors ~86 apart: a bridge exp(m_I - m_J) takes the step factors' shift (Anchors)
  strong = jnp.where(upper, jnp.where(t % SUB == 0, -12.0, -4.7 - 0.3 * u), -u)
  g = jnp.where(t < CHUNK, -u, jnp.where(t < 2 * CHUNK, strong, jnp.where(t % 3 == 0, -20.0, -u)))
  assert factors.chunk_layouts(g)[0, :, 0].tolist() == [
      factors.WHOLE_CHUNK, factors.PER_SUB_CHUNK, factors.SUB_CHUNKS
  ]
  return dict(x, g=g.astype(x["g"].dtype))


def with_halves(x, seed=0):
  """x (T = 192) whose scores take HALVES in chunks 0 and 1 and WHOLE_CHUNK in chunk 2:
    g in [-4, -2] in the first channel and in [-1, 0] in the others (the first channel
    decays by ~190 over the chunk and no anchor holds it, a half's anchor does; the others
    keep the pairs across the halves weighty), then g = -4.95 a token (the gate's lower
    bound of -5: its halves reach 79.2 of the HALF_LIMIT of 80, factors of exp(+-79)), then
    mild gates."""
  B, T, H, D = x["g"].shape
  assert T == 3 * CHUNK
  u = jax.random.uniform(jax.random.key(seed), x["g"].shape)
  t = jnp.arange(T)[None, :, None, None]
  first = jnp.where(jnp.arange(D) == 0, -2.0 - 2.0 * u, -u)
  g = jnp.where(t < CHUNK, first, jnp.where(t < 2 * CHUNK, -4.95, -u))
  assert factors.score_layouts(g)[0, :, 0].tolist() == [
      factors.HALVES, factors.HALVES, factors.WHOLE_CHUNK
  ]
  return dict(x, g=g.astype(x["g"].dtype))


def at_the_whole_chunk_limit(x):
  """x whose first channel decays by just under 2 * WHOLE_LIMIT over every chunk (-1.9 a
    token: factors of exp(+-59) through one anchor), the others mildly (g in [-0.5, 0]):
    every chunk WHOLE_CHUNK, for the scores and the key gradients alike."""
  B, T, H, D = x["g"].shape
  per_token = -(2.0 * factors.WHOLE_LIMIT - 2.0) / (CHUNK - 1)
  g = jnp.where(jnp.arange(D) == 0, per_token, -0.5 * x["g"] / jnp.min(x["g"]))
  padded = (T + CHUNK - 1) // CHUNK * CHUNK
  full = jnp.pad(g, ((0, 0), (0, padded - T), (0, 0), (0, 0)))
  for layouts in (factors.chunk_layouts(full), factors.score_layouts(full)):
    assert bool((layouts == factors.WHOLE_CHUNK).all())
  return dict(x, g=g.astype(x["g"].dtype))


def one_chunk_of_each_scores_layout(x):
  """x (T = 192) whose chunks take the scores' three layouts in turn: WHOLE_CHUNK (g in
    [-1, 0]), HALVES (g = -4.95 a token in the first channel, the others as the first
    chunk's: the pairs across the halves weigh) and SUB_CHUNKS (mild, g = -20 every third
    token)."""
  u = jax.random.uniform(jax.random.key(1), x["g"].shape)
  t = jnp.arange(x["g"].shape[1])[None, :, None, None]
  first_channel = jnp.arange(x["g"].shape[-1]) == 0
  halves = jnp.where(first_channel, -4.95, -u)
  g = jnp.where(t < 64, -u, jnp.where(t < 128, halves, jnp.where(t % 3 == 0, -20.0, -u)))
  assert factors.score_layouts(g)[0, :, 0].tolist() == [
      factors.WHOLE_CHUNK, factors.HALVES, factors.SUB_CHUNKS
  ]
  return dict(x, g=g.astype(x["g"].dtype))


def mosaic_three_layouts(seed):
  """bf16 inputs with one 64-token chunk in each in-chunk layout (with_three_layouts), at
    the smallest head sizes the Mosaic GPU kernels take (64)."""
  return with_three_layouts(make_inputs(seed=seed, T=192, H=1, Dk=64, Dv=64, dtype=jnp.bfloat16))


def rel_rms(ref, x):
  ref, x = jnp.asarray(ref, jnp.float32), jnp.asarray(x, jnp.float32)
  return float(jnp.sqrt(jnp.mean((ref - x)**2) / jnp.mean(ref**2)))


# the tests are dominated by XLA:CPU compile time; cheap codegen keeps them fast
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def fast_jit(fn, **kw):
  return jax.jit(fn, compiler_options=FAST_COMPILE, **kw)


def outputs_and_grads(fn, *args):
  """(fn(*args) = (o, final state), the gradients of every argument) in one compiled
    program: the gradients of the random linear functional sum(o w_o) + sum(s w_s) that
    loss_fn forms (w_o in o's dtype, as its cast gives it), from the forward's own pullback,
    so that the kernels are traced and compiled once."""

  def run(*args):
    (o, s), pullback = jax.vjp(fn, *args)
    w_o = jax.random.normal(jax.random.key(101), o.shape).astype(o.dtype)
    w_s = jax.random.normal(jax.random.key(102), s.shape).astype(s.dtype)
    return (o, s), pullback((w_o, w_s))

  return fast_jit(run)(*args)


def loss_fn(fn, segment_ids, **extra):
  """Random linear functional of the output and the final state (fresh, dense cotangents)."""

  def loss(q, k, v, g, h0, *beta):
    o, s = fn(q, k, v, g, *beta, initial_state=h0, segment_ids=segment_ids, output_final_state=True,
              **extra)
    w_o = jax.random.normal(jax.random.key(101), o.shape)
    w_s = jax.random.normal(jax.random.key(102), s.shape)
    return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(s * w_s)

  return loss

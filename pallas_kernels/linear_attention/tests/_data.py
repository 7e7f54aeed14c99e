"""Fresh random inputs for the linear-attention tests."""
import jax
import jax.numpy as jnp

from pallas_kernels.linear_attention import _diagonal_blocks as diag
from pallas_kernels.linear_attention._inputs import CHUNK


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


def bounded_chunks(g):
  """[B, n, H]: whether each chunk of g [B, T, H, D] may factor its decays whole
    (_chunk_factors; T a multiple of the chunk)."""
  B, T, H, D = g.shape
  b = jnp.cumsum(g.astype(jnp.float32).reshape(B, T // CHUNK, CHUNK, H, D), axis=2)
  span = jnp.max(b.max(axis=2) - b.min(axis=2), axis=-1)
  return span <= 2 * diag.FACTOR_LIMIT


def rel_rms(ref, x):
  ref, x = jnp.asarray(ref, jnp.float32), jnp.asarray(x, jnp.float32)
  return float(jnp.sqrt(jnp.mean((ref - x)**2) / jnp.mean(ref**2)))


# the tests are dominated by XLA:CPU compile time; cheap codegen keeps them fast
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def fast_jit(fn, **kw):
  return jax.jit(fn, compiler_options=FAST_COMPILE, **kw)


def loss_fn(fn, segment_ids, **extra):
  """Random linear functional of the output and the final state (fresh, dense cotangents)."""

  def loss(q, k, v, g, h0, *beta):
    o, s = fn(q, k, v, g, *beta, initial_state=h0, segment_ids=segment_ids, output_final_state=True,
              **extra)
    w_o = jax.random.normal(jax.random.key(101), o.shape)
    w_s = jax.random.normal(jax.random.key(102), s.shape)
    return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(s * w_s)

  return loss

"""The per-channel log decay of KDA layers, from the gate projection f [B, T, H, D]:

    g = -exp(a_log) * softplus(f + dt_bias)              (Kimi Linear)
    g = L * sigmoid(exp(a_log) * (f + dt_bias))          (a lower bound L < 0: Kimi K3)

with a_log [H] and dt_bias [H, D], in fp32. Passed to the KDA ops as `decay=DecayGate(...)`
with f in place of g, the kernels compute g in their in-chunk cumulative sum
(`_chunk_cumsum.decay_cumsum`) instead of reading a g that XLA wrote: f (bf16) is read
once and no fp32 g goes through memory, forward or backward.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

F32 = jnp.float32
# The released models' initialisation (FLA's): A = exp(a_log) uniform in A_RANGE per head,
# dt = softplus(dt_bias) log-uniform in DT_RANGE per channel.
A_RANGE = (1.0, 16.0)
DT_RANGE = (1e-3, 1e-1)


def dt_bias_for(dt):
  """softplus^-1(dt): the dt_bias whose softplus is dt."""
  return dt + jnp.log(-jnp.expm1(-dt))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecayGate:
  """The decay's parameters: a_log [H], dt_bias [H, D] (their own dtypes; fp32 math) and
    the lower bound L (0: none, the softplus form)."""
  a_log: jax.Array
  dt_bias: jax.Array
  lower_bound: float = dataclasses.field(default=0.0, metadata=dict(static=True))

  # meshes.per_shard: parameters, whole on every device (a_log's heads could equal the
  # batch and be split as rows)
  whole_on_every_device = True

  def __post_init__(self):
    if self.lower_bound > 0:
      raise ValueError(f"DecayGate lower_bound = {self.lower_bound}: must be < 0, or 0 for none")

  @classmethod
  def drawn(cls, key, heads, channels, lower_bound=0.0):
    """Parameters drawn as the released models initialise them (A_RANGE, DT_RANGE)."""
    ka, kd = jax.random.split(key)
    a = jax.random.uniform(ka, (heads,), F32, *A_RANGE)
    log_dt = jax.random.uniform(kd, (heads, channels), F32, *map(jnp.log, DT_RANGE))
    return cls(jnp.log(a), dt_bias_for(jnp.exp(log_dt)), lower_bound)

  def check(self, f):
    """Raises a one-line ValueError unless a_log is [H] and dt_bias [H, D] for f [B, T, H, D]."""
    H, D = f.shape[2:]
    if tuple(self.a_log.shape) != (H,):
      raise ValueError(f"decay a_log has shape {tuple(self.a_log.shape)}, expected ({H},) "
                       f"for the gate projection's {H} heads")
    if tuple(self.dt_bias.shape) != (H, D):
      raise ValueError(f"decay dt_bias has shape {tuple(self.dt_bias.shape)}, expected "
                       f"({H}, {D}) for the gate projection's heads and channels")

  def rate(self):
    """exp(a_log) as [H, 1], fp32."""
    return jnp.exp(self.a_log.astype(F32))[:, None]

  def __call__(self, f):
    """g, fp32 [B, T, H, D]: the plain-JAX form (the reference; the layers' form without
      the fused kernels)."""
    u = f.astype(F32) + self.dt_bias.astype(F32)
    if self.lower_bound < 0:
      return self.lower_bound * jax.nn.sigmoid(self.rate() * u)
    return -self.rate() * jax.nn.softplus(u)


# The kernels' forms: exp, log1p and division, which the Triton lowering has.


def _sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x))


def _softplus(u):
  return jnp.maximum(u, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(u)))


def apply(u, rate, lower_bound):
  """g from u = f + dt_bias and rate = exp(a_log), broadcast against each other."""
  if lower_bound < 0:
    return lower_bound * _sigmoid(rate * u)
  return -rate * _softplus(u)


def derivatives(u, rate, lower_bound):
  """(dg/du, dg/drate) of `apply`, elementwise."""
  if lower_bound < 0:
    s = _sigmoid(rate * u)
    slope = lower_bound * s * (1.0 - s)
    return slope * rate, slope * u
  return -rate * _sigmoid(u), -_softplus(u)

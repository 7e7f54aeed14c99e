"""What follows the convolution in a row, and its gradient: SiLU, the round to the output
dtype, and the per-head L2 norm (the reference's l2_normalize)."""

import jax
import jax.numpy as jnp

F32 = jnp.float32
EPS = 1e-6  # that of the reference's l2_normalize


def activate(y, dtype, normalize):
  """SiLU, the round to the output dtype, and the norm: (output fp32, 1/|u| or None)."""
  u = (y * jax.nn.sigmoid(y)).astype(dtype).astype(F32)
  if not normalize:
    return u, None
  inv = jax.lax.rsqrt(jnp.sum(u * u, axis=1, keepdims=True) + EPS)
  return u * inv, inv


def pre_activation_grad(y, dout, dtype, normalize):
  """d loss / d (convolution output), given d loss / d output (fp32)."""
  n, inv = activate(y, dtype, normalize)
  du = inv * (dout - n * jnp.sum(dout * n, axis=1, keepdims=True)) if normalize else dout
  sig = jax.nn.sigmoid(y)
  return du * sig * (1.0 + y * (1.0 - sig))

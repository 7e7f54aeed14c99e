"""The residual mix in plain JAX: the ground truth the kernel is checked against."""

import jax.numpy as jnp

from pallas_kernels.residual_mix.input_checks import check_residual_mix_inputs


def residual_mix_reference(x, history, weights):
  """x [B, T, d], history [W, B, T, d], weights [W + 1] fp32 -> [B, T, d] in x's dtype.

    y = weights[0] * x + sum_j weights[j + 1] * history[j], accumulated in fp32.
    """
  check_residual_mix_inputs(x, history, weights)
  w = weights.astype(jnp.float32)
  mixed = jnp.einsum("w,w...->...", w[1:], history.astype(jnp.float32))
  return (w[0] * x.astype(jnp.float32) + mixed).astype(x.dtype)

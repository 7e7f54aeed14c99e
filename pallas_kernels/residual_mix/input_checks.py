"""Shape and dtype checks for the residual mix: a ValueError naming the argument."""

import jax.numpy as jnp


def check_residual_mix_inputs(x, history, weights) -> None:
  if x.ndim < 1:
    raise ValueError(f"x must have at least one axis, got shape {tuple(x.shape)}")
  if history.ndim != x.ndim + 1 or tuple(history.shape[1:]) != tuple(x.shape):
    raise ValueError(f"history must have shape [W, *x.shape] = [W, {', '.join(map(str, x.shape))}]"
                     f", got {tuple(history.shape)}")
  if weights.shape != (history.shape[0] + 1,):
    raise ValueError(f"weights must have shape [W + 1] = [{history.shape[0] + 1}], "
                     f"got {tuple(weights.shape)}")
  for name, a in (("x", x), ("history", history), ("weights", weights)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"{name} must be floating-point, got {a.dtype}")

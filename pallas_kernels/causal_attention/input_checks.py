"""Shape and dtype checks of causal attention's inputs, each naming the argument at fault."""

import jax.numpy as jnp

from pallas_kernels.input_checks import require


def check_inputs(q, k, v, segment_ids, block_q: int) -> None:
  """q, k [B, T, H, Dk], v [B, T, H, Dv], segment_ids int [B, T] or None."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    require(
        hasattr(x, "shape") and x.ndim == 4,
        f"{name} must have shape [B, T, H, D], got {getattr(x, 'shape', type(x).__name__)}")
    require(jnp.issubdtype(x.dtype, jnp.floating),
            f"{name} must be a floating-point array, got dtype {x.dtype}")
  require(k.shape == q.shape, f"k must have the shape of q {q.shape}, got {k.shape}")
  require(v.shape[:3] == q.shape[:3],
          f"v must have shape {(*q.shape[:3], 'Dv')} to match q {q.shape}, got {v.shape}")
  if segment_ids is not None:
    require(
        hasattr(segment_ids, "shape") and segment_ids.shape == q.shape[:2] and
        jnp.issubdtype(segment_ids.dtype, jnp.integer),
        f"segment_ids must be an integer array of shape {q.shape[:2]}, got "
        f"{getattr(segment_ids, 'shape', segment_ids)}")
  require(
      isinstance(block_q, int) and not isinstance(block_q, bool) and block_q > 0,
      f"block_q must be a positive int, got {block_q!r}")

"""Shape, dtype and label checks for the cross-entropy losses.

Each check raises a ValueError naming the argument and its shape, so a caller never
sees a traceback from deep inside JAX. Label values are checked only when they are
concrete (not traced): out-of-range labels inside jit cannot be detected at trace time.
"""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.input_checks import require, require_array


def check_cross_entropy_inputs(hidden, lm_head, labels, ignore_index: int) -> None:
  require_array("hidden", hidden, 2, "[N, D]")
  require_array("lm_head", lm_head, 2, "[D, V]")
  require_array("labels", labels, 1, "[N]")
  require(
      jnp.issubdtype(hidden.dtype, jnp.floating) and jnp.issubdtype(lm_head.dtype, jnp.floating),
      f"hidden and lm_head must be floating-point, got {hidden.dtype} and "
      f"{lm_head.dtype}")
  require(jnp.issubdtype(labels.dtype, jnp.integer),
          f"labels must be an integer array, got dtype {labels.dtype}")
  require(
      hidden.shape[1] == lm_head.shape[0],
      f"hidden has D={hidden.shape[1]} (shape {tuple(hidden.shape)}) but lm_head "
      f"has D={lm_head.shape[0]} (shape {tuple(lm_head.shape)})")
  require(
      labels.shape[0] == hidden.shape[0],
      f"labels has {labels.shape[0]} entries (shape {tuple(labels.shape)}) but "
      f"hidden has N={hidden.shape[0]} tokens")
  if not isinstance(labels, jax.core.Tracer):
    values = np.asarray(labels)
    vocab = lm_head.shape[1]
    bad = (values != ignore_index) & ((values < 0) | (values >= vocab))
    require(
        not bad.any(), f"labels must lie in [0, {vocab}) or equal ignore_index={ignore_index}; "
        f"got {values[bad][:4].tolist()} at positions {np.flatnonzero(bad)[:4].tolist()}")

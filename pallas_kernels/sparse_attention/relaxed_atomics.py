"""Relaxed-order atomic adds for the Pallas (Triton) kernels of this package.

Pallas lowers `atomic_add` to an acquire-release atomic that returns the old value.
Scattering gradient rows needs neither the ordering nor the value; the relaxed form (a
fire-and-forget reduction) makes the sparse-attention dk/dv scatter faster
(docs/kernel_tuning.md, "Relaxed atomics"). Pallas has no memory-order argument, so
`enable()` sets the default order of its Triton atomic lowering to relaxed; the
backward kernel calls it when it is built (importing this package changes nothing).
Acquire-release only matters for kernels that synchronise through atomics (locks,
flags); none here does.
"""
import warnings

_PINNED = "0.11.2"  # the lowering's private signature was checked against this JAX


def enable():
  """Makes Pallas Triton atomics relaxed; returns False (and warns) if it cannot."""
  import jax
  try:
    from jax._src.pallas.triton import lowering
    semantic = lowering.tt_dialect.MemSemantic
    mask, _, scope = lowering._atomic_rmw.__defaults__
  except (ImportError, AttributeError, ValueError) as e:
    warnings.warn(f"relaxed atomics unavailable on jax {jax.__version__} ({e}); the "
                  "sparse-attention backward keeps acquire-release atomics (slower)")
    return False
  lowering._atomic_rmw.__defaults__ = (mask, semantic.RELAXED, scope)
  return True


def enabled():
  from jax._src.pallas.triton import lowering
  return lowering._atomic_rmw.__defaults__[1] == lowering.tt_dialect.MemSemantic.RELAXED

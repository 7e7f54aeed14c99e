"""Shape and dtype checks shared by the reference and the Pallas kernels.

Each check raises a ValueError that names the offending argument and its shape, so a
caller never sees a traceback from deep inside JAX.
"""

import jax.numpy as jnp

from pallas_kernels.input_checks import require


def _shape(x) -> tuple:
  return tuple(getattr(x, "shape", ()))


def check_floating(name: str, x, ndim: int, layout: str) -> None:
  require(
      hasattr(x, "shape") and hasattr(x, "dtype"),
      f"{name} must be an array {layout}, got {type(x).__name__}")
  require(x.ndim == ndim, f"{name} must have shape {layout}, got shape {_shape(x)}")
  require(jnp.issubdtype(x.dtype, jnp.floating),
          f"{name} must be a floating-point array, got dtype {x.dtype}")


def check_integer(name: str, x, ndim: int, layout: str) -> None:
  require(
      hasattr(x, "shape") and hasattr(x, "dtype"),
      f"{name} must be an array {layout}, got {type(x).__name__}")
  require(x.ndim == ndim, f"{name} must have shape {layout}, got shape {_shape(x)}")
  require(jnp.issubdtype(x.dtype, jnp.integer),
          f"{name} must be an integer array, got dtype {x.dtype}")


def check_positive_int(name: str, value) -> None:
  require(
      isinstance(value, int) and not isinstance(value, bool) and value > 0,
      f"{name} must be a positive int, got {value!r}")


def check_indexer_inputs(q_idx, k_idx, w, top_k, segment_ids, queries_are_a_range=False) -> None:
  """q_idx [B,T,HI,DI], k_idx [B,Tk,DI], w [B,T,HI], segment_ids [B,Tk] or None.

    Tk is T unless the queries are a range of the keys' positions (Tk >= T)."""
  check_floating("q_idx", q_idx, 4, "[B, T, HI, DI]")
  check_floating("k_idx", k_idx, 3, "[B, Tk, DI]")
  check_floating("w", w, 3, "[B, T, HI]")
  b, t, hi, di = q_idx.shape
  tk = k_idx.shape[1] if queries_are_a_range else t
  require(
      k_idx.shape == (b, tk, di) and tk >= t,
      f"k_idx must have shape {(b, max(tk, t), di)} to match q_idx {q_idx.shape}, "
      f"got {k_idx.shape}")
  require(w.shape == (b, t, hi),
          f"w must have shape {(b, t, hi)} to match q_idx {q_idx.shape}, got {w.shape}")
  check_positive_int("top_k", top_k)
  if segment_ids is not None:
    check_integer("segment_ids", segment_ids, 2, "[B, Tk]")
    require(segment_ids.shape == (b, tk),
            f"segment_ids must have shape {(b, tk)}, got {segment_ids.shape}")


def check_attention_inputs(q, k, v, indices) -> None:
  """q [B,T,HQ,D], k/v [B,Tk,HK,D], indices [B,T,K] with HQ a multiple of HK.

    Tk is T for self-attention; a device holding a range of the queries passes every key
    (Tk >= T) and indices into them."""
  check_floating("q", q, 4, "[B, T, HQ, D]")
  check_floating("k", k, 4, "[B, Tk, HK, D]")
  check_floating("v", v, 4, "[B, Tk, HK, D]")
  check_integer("indices", indices, 3, "[B, T, K]")
  b, t, hq, d = q.shape
  require(k.shape[0] == b and k.shape[1] >= t and k.shape[3] == d,
          f"k must have shape [{b}, Tk >= {t}, HK, {d}] to match q {q.shape}, "
          f"got {k.shape}")
  require(v.shape == k.shape, f"v must have the shape of k {k.shape}, got {v.shape}")
  hk = k.shape[2]
  require(hk > 0 and hq % hk == 0,
          f"q heads ({hq}) must be a multiple of k heads ({hk}); q {q.shape}, k {k.shape}")
  require(indices.shape[:2] == (b, t) and indices.shape[2] > 0,
          f"indices must have shape [{b}, {t}, K] with K > 0, got {indices.shape}")

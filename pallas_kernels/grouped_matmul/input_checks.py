"""Shape and dtype checks for grouped matmuls.

Each check raises a ValueError naming the argument and its shape, so a caller never
sees a traceback from deep inside JAX.
"""

import jax.numpy as jnp


def _require(condition: bool, message: str) -> None:
  if not condition:
    raise ValueError(message)


def _array(name: str, x, ndim: int, layout: str) -> None:
  _require(
      hasattr(x, "shape") and hasattr(x, "dtype"),
      f"{name} must be an array {layout}, got {type(x).__name__}")
  _require(x.ndim == ndim, f"{name} must have shape {layout}, got shape {tuple(x.shape)}")


def _group_sizes(group_sizes, num_groups: int, rhs_name: str) -> None:
  _array("group_sizes", group_sizes, 1, "[G]")
  _require(jnp.issubdtype(group_sizes.dtype, jnp.integer),
           f"group_sizes must be an integer array, got dtype {group_sizes.dtype}")
  _require(
      group_sizes.shape[0] == num_groups,
      f"group_sizes has {group_sizes.shape[0]} entries but {rhs_name} has "
      f"G={num_groups} groups")


def check_grouped_matmul_inputs(lhs, rhs, group_sizes) -> None:
  _array("lhs", lhs, 2, "[M, K]")
  _array("rhs", rhs, 3, "[G, K, N]")
  _require(
      jnp.issubdtype(lhs.dtype, jnp.floating) and jnp.issubdtype(rhs.dtype, jnp.floating),
      f"lhs and rhs must be floating-point, got {lhs.dtype} and {rhs.dtype}")
  _require(
      lhs.shape[1] == rhs.shape[1],
      f"lhs has K={lhs.shape[1]} (shape {tuple(lhs.shape)}) but rhs has "
      f"K={rhs.shape[1]} (shape {tuple(rhs.shape)})")
  _group_sizes(group_sizes, rhs.shape[0], "rhs")


def check_grouped_lora_inputs(x, a, b, group_sizes) -> None:
  _array("x", x, 2, "[M, K]")
  _array("a", a, 3, "[G, K, r]")
  _array("b", b, 3, "[G, r, N]")
  _require(
      x.shape[1] == a.shape[1],
      f"x has K={x.shape[1]} (shape {tuple(x.shape)}) but a has K={a.shape[1]} "
      f"(shape {tuple(a.shape)})")
  _require(a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1],
           f"a {tuple(a.shape)} and b {tuple(b.shape)} must share G and the rank r")
  _group_sizes(group_sizes, a.shape[0], "a")

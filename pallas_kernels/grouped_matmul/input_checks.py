"""Shape and dtype checks for grouped matmuls.

Each check raises a ValueError naming the argument and its shape, so a caller never
sees a traceback from deep inside JAX.
"""

import jax.numpy as jnp

from pallas_kernels.input_checks import require, require_array


def _group_sizes(group_sizes, num_groups: int, rhs_name: str) -> None:
  require_array("group_sizes", group_sizes, 1, "[G]")
  require(jnp.issubdtype(group_sizes.dtype, jnp.integer),
          f"group_sizes must be an integer array, got dtype {group_sizes.dtype}")
  require(
      group_sizes.shape[0] == num_groups,
      f"group_sizes has {group_sizes.shape[0]} entries but {rhs_name} has "
      f"G={num_groups} groups")


def check_grouped_matmul_inputs(lhs, rhs, group_sizes) -> None:
  require_array("lhs", lhs, 2, "[M, K]")
  require_array("rhs", rhs, 3, "[G, K, N]")
  require(
      jnp.issubdtype(lhs.dtype, jnp.floating) and jnp.issubdtype(rhs.dtype, jnp.floating),
      f"lhs and rhs must be floating-point, got {lhs.dtype} and {rhs.dtype}")
  require(
      lhs.shape[1] == rhs.shape[1],
      f"lhs has K={lhs.shape[1]} (shape {tuple(lhs.shape)}) but rhs has "
      f"K={rhs.shape[1]} (shape {tuple(rhs.shape)})")
  _group_sizes(group_sizes, rhs.shape[0], "rhs")


def check_grouped_lora_inputs(x, a, b, group_sizes) -> None:
  require_array("x", x, 2, "[M, K]")
  require_array("a", a, 3, "[G, K, r]")
  require_array("b", b, 3, "[G, r, N]")
  require(
      x.shape[1] == a.shape[1],
      f"x has K={x.shape[1]} (shape {tuple(x.shape)}) but a has K={a.shape[1]} "
      f"(shape {tuple(a.shape)})")
  require(a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1],
          f"a {tuple(a.shape)} and b {tuple(b.shape)} must share G and the rank r")
  _group_sizes(group_sizes, a.shape[0], "a")

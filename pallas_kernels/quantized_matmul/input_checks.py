"""Shape, dtype and format checks for matmuls against packed weights: each raises a
one-line ValueError naming the argument."""

import jax.numpy as jnp

from . import formats
from pallas_kernels.input_checks import require, require_array


def check_packed_weights(codes, scales, fmt: formats.Format, k: int, stacked: bool) -> None:
  """codes/scales of one [N, K] matrix (stacked: [G, N, K] matrices) in format `fmt`."""
  lead = "G, " if stacked else ""
  require_array("codes", codes, 3 if stacked else 2, f"[{lead}N, K/{fmt.per_code}]")
  require_array("scales", scales, 3 if stacked else 2, f"[{lead}ceil(N/{fmt.block[0]}), "
                f"ceil(K/{fmt.block[1]})]")
  require(codes.dtype == fmt.codes_dtype,
          f"{fmt.name} codes must be {jnp.dtype(fmt.codes_dtype)}, got {codes.dtype}")
  require(scales.dtype == fmt.scales_dtype,
          f"{fmt.name} scales must be {jnp.dtype(fmt.scales_dtype)}, got {scales.dtype}")
  n = codes.shape[-2]
  require(
      codes.shape[-1] * fmt.per_code == k,
      f"codes {tuple(codes.shape)} hold K={codes.shape[-1] * fmt.per_code} inputs but the "
      f"activations have K={k}")
  reason = fmt.check_matrix(n, k)
  require(reason is None, reason or "")
  want = fmt.scales_shape(n, k)
  require(
      tuple(scales.shape[-2:]) == want,
      f"{fmt.name} scales of an [{n}, {k}] matrix must be {list(want)}, got "
      f"{list(scales.shape[-2:])}")
  if stacked:
    require(codes.shape[0] == scales.shape[0],
            f"codes have G={codes.shape[0]} matrices but scales G={scales.shape[0]}")


def _bfloat16(name: str, x) -> None:
  # The weights are dequantized to bf16 and multiplied on bf16 tensor cores.
  require(x.dtype == jnp.bfloat16, f"{name} must be bfloat16, got dtype {x.dtype}")


def check_quantized_grouped_matmul_inputs(lhs, codes, scales, group_sizes, fmt: str):
  fmt = formats.get(fmt)
  require_array("lhs", lhs, 2, "[M, K]")
  _bfloat16("lhs", lhs)
  check_packed_weights(codes, scales, fmt, lhs.shape[1], stacked=True)
  require_array("group_sizes", group_sizes, 1, "[G]")
  require(jnp.issubdtype(group_sizes.dtype, jnp.integer),
          f"group_sizes must be an integer array, got dtype {group_sizes.dtype}")
  require(
      group_sizes.shape[0] == codes.shape[0],
      f"group_sizes has {group_sizes.shape[0]} entries but codes have G={codes.shape[0]} "
      f"matrices")


def check_quantized_matmul_inputs(x, codes, scales, fmt: str):
  fmt = formats.get(fmt)
  require(hasattr(x, "shape") and x.ndim >= 1, "x must be an array [..., K]")
  _bfloat16("x", x)
  check_packed_weights(codes, scales, fmt, x.shape[-1], stacked=False)

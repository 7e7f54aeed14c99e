"""Small helpers shared by the Pallas kernels: backend choice and padding."""

import jax
import jax.numpy as jnp


def use_interpret() -> bool:
  """Pallas Triton kernels run compiled on GPU and interpreted on CPU (CI)."""
  return jax.default_backend() == "cpu"


def next_power_of_2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def tile_rows(n: int) -> int:
  """Rows of a matmul tile: a power of 2 of at least 16 (Triton's dot minimum)."""
  return max(16, next_power_of_2(n))


def pad_axis(x, axis: int, size: int, value=0):
  """Pads axis of x at the end up to size."""
  pad = size - x.shape[axis]
  if pad <= 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def check_head_dim(name: str, d: int) -> None:
  if d < 16 or d & (d - 1):
    raise ValueError(f"{name} head dim must be a power of 2 >= 16 for the Pallas "
                     f"kernel, got {d}")

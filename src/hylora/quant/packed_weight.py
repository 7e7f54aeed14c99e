"""A frozen linear's weight kept as its checkpoint ships it: packed codes and their scales
(formats: `pallas_kernels.quantized_matmul.formats`).

One `PackedWeight` stands where the bf16 kernel would: its codes and scales hold every
matrix in the checkpoint's orientation `[*stack, N, K / per_code]` (N = the flattened
out dims, K = the flattened in dims; stack = the scanned layers and the expert slots),
while `shape` is the bf16 kernel's model layout `[*stack, *in, *out]`. The matmuls read
it through `hylora.quant.matmul`, whose kernels dequantize tiles on the way into the
matrix units; `dequantize()` is the whole bf16 weight, for references and merges only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_matmul import formats


def _static(default=dataclasses.MISSING):
  return dataclasses.field(default=default, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
  codes: Any  # [*stack, N, K / per_code]
  scales: Any  # [*stack, ceil(N / block rows), ceil(K / block columns)]
  format: str = _static()
  in_shape: tuple[int, ...] = _static()
  out_shape: tuple[int, ...] = _static()

  @property
  def fmt(self) -> formats.Format:
    return formats.get(self.format)

  @property
  def stack_shape(self) -> tuple[int, ...]:
    return tuple(self.codes.shape[:-2])

  @property
  def n(self) -> int:
    return math.prod(self.out_shape)

  @property
  def k(self) -> int:
    return math.prod(self.in_shape)

  @property
  def shape(self) -> tuple[int, ...]:
    """The bf16 kernel's shape (model layout)."""
    return (*self.stack_shape, *self.in_shape, *self.out_shape)

  @property
  def nbytes(self) -> int:
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in (self.codes, self.scales))

  def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
    """The whole weight in the model layout `shape`, in `dtype` (references, merges)."""
    w = formats.dequantize(self.codes, self.scales, self.fmt, dtype)  # [*stack, N, K]
    return jnp.swapaxes(w, -1, -2).reshape(self.shape)

  @classmethod
  def abstract(cls, fmt: str, stack: tuple[int, ...], in_shape: tuple[int, ...],
               out_shape: tuple[int, ...]) -> "PackedWeight":
    """ShapeDtypeStructs of a packed weight whose bf16 kernel is [*stack, *in, *out]."""
    f = formats.get(fmt)
    n, k = math.prod(out_shape), math.prod(in_shape)
    reason = f.check_matrix(n, k)
    if reason:
      raise ValueError(reason)
    return cls(jax.ShapeDtypeStruct((*stack, *f.codes_shape(n, k)), f.codes_dtype),
               jax.ShapeDtypeStruct((*stack, *f.scales_shape(n, k)), f.scales_dtype), fmt,
               tuple(in_shape), tuple(out_shape))

  @classmethod
  def from_kernel(cls, kernel: jax.Array, fmt: str, in_dims: int,
                  stack_dims: int) -> "PackedWeight":
    """Quantize a model-layout kernel [*stack, *in, *out] (random bases, tests)."""
    stack = kernel.shape[:stack_dims]
    in_shape = kernel.shape[stack_dims:stack_dims + in_dims]
    out_shape = kernel.shape[stack_dims + in_dims:]
    matrix = kernel.reshape(*stack, math.prod(in_shape), math.prod(out_shape))
    codes, scales = formats.quantize(jnp.swapaxes(matrix, -1, -2), fmt)
    return cls(codes, scales, fmt, tuple(in_shape), tuple(out_shape))


def is_packed(x) -> bool:
  return isinstance(x, PackedWeight)


def packed_axes(axes: tuple | None, stack_dims: int, in_dims: int) -> tuple | None:
  """A packed kernel's logical axes [*stack, N, K] from its bf16 kernel's
  [*stack, *in, *out]: the flattened dims keep their leading dim's axis."""
  if axes is None:
    return None
  return (*axes[:stack_dims], axes[stack_dims + in_dims], axes[stack_dims])


def dequantized(frozen: dict, dtype=None) -> dict:
  """The frozen tree with every `PackedWeight` replaced by its bf16 (or `dtype`) kernel:
  the twin a bf16 checkpoint of the same values would load."""
  return jax.tree.map(
      lambda x: x.dequantize(dtype or jnp.bfloat16)
      if isinstance(x, PackedWeight) else x, frozen, is_leaf=lambda x: isinstance(x, PackedWeight))

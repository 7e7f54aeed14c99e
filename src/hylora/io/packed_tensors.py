"""How a packed linear sits in a Hugging Face checkpoint: per format, the tensors that
stand for its `<module>.weight`, their safetensors dtypes and shapes, and the exact
conversion between those tensors and `PackedWeight`'s codes and scales (both already in
the checkpoint's `[out, in]` orientation: nothing is transposed, no bit changes).

  fp8_block  <module>.weight F8_E4M3 [out, in], <module>.weight_scale_inv F32
             [ceil(out/128), ceil(in/128)] (DeepSeek-V3/V3.2, Kimi K2, MiniMax-M2)
  mxfp4      <module>.weight_packed U8 [out, in/2], <module>.weight_scale U8 [out, in/32]
             (compressed-tensors `mxfp4-pack-quantized`; a `weight_shape` is checked
             when present)
  int4       <module>.weight_packed I32 [out, in/8], <module>.weight_scale BF16
             [out, in/32], <module>.weight_shape I32 [2] = [out, in] (compressed-tensors
             `pack-quantized`): each int32 is four of the codes' bytes, little-endian
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pallas_kernels.quantized_matmul import formats

WEIGHT = "weight"
SHAPE_DTYPES = ("I32", "I64")  # compressed-tensors writes torch.tensor(shape): int64


@dataclasses.dataclass(frozen=True)
class DiskLayout:
  format: str
  codes: str  # the suffix that replaces "weight" in `<module>.weight`
  scales: str
  shape: str | None  # compressed-tensors' `weight_shape` [out, in]
  shape_required: bool
  codes_dtype: str  # safetensors dtype names
  scales_dtype: str
  code_bytes: int  # codes bytes per stored element (an int32 holds four)

  @property
  def fmt(self) -> formats.Format:
    return formats.get(self.format)

  def names(self, weight_name: str) -> dict[str, str]:
    """role ("codes", "scales", "shape") -> tensor name, for the bf16 name `<m>.weight`."""
    base = module(weight_name)
    out = {"codes": f"{base}.{self.codes}", "scales": f"{base}.{self.scales}"}
    if self.shape:
      out["shape"] = f"{base}.{self.shape}"
    return out

  def codes_shape(self, n: int, k: int) -> tuple[int, int]:
    rows, cols = self.fmt.codes_shape(n, k)
    return rows, cols // self.code_bytes

  def scales_shape(self, n: int, k: int) -> tuple[int, int]:
    return self.fmt.scales_shape(n, k)

  def columns(self, lo: int, hi: int) -> tuple[slice, slice]:
    """The stored columns holding codes columns [lo, hi), and the cut of their bytes."""
    first = lo // self.code_bytes
    last = -(-hi // self.code_bytes)
    skip = lo - first * self.code_bytes
    return slice(first, last), slice(skip, skip + hi - lo)

  def codes_from_disk(self, stored: np.ndarray) -> np.ndarray:
    if self.code_bytes == 1:
      return stored
    little = np.ascontiguousarray(stored).astype("<i4", copy=False)
    return little.view(np.uint8).reshape(*stored.shape[:-1], -1)

  def codes_to_disk(self, codes: np.ndarray) -> np.ndarray:
    if self.code_bytes == 1:
      return codes
    return np.ascontiguousarray(codes).view("<i4").astype(np.int32, copy=False)


LAYOUTS = {
    "fp8_block":
        DiskLayout("fp8_block", WEIGHT, "weight_scale_inv", None, False, "F8_E4M3", "F32", 1),
    "mxfp4":
        DiskLayout("mxfp4", "weight_packed", "weight_scale", "weight_shape", False, "U8", "U8", 1),
    "int4":
        DiskLayout("int4", "weight_packed", "weight_scale", "weight_shape", True, "I32", "BF16", 4),
}
# Names only a packed linear has: present next to a bf16 one, the checkpoint is quantized.
PACKED_SUFFIXES = ("weight_scale_inv", "weight_packed", "weight_scale", "weight_shape")


def module(tensor_name: str) -> str:
  """`<module>.weight` (or one of its packed tensors) -> `<module>`."""
  base, _, last = tensor_name.rpartition(".")
  return base if base and last in (WEIGHT,) + PACKED_SUFFIXES else tensor_name


def layout(fmt: str) -> DiskLayout:
  return LAYOUTS[fmt]

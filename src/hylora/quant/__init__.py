"""A frozen base kept in its shipped quantized formats (docs/quantized_base.md)."""

from hylora.quant.packed_weight import PackedWeight, is_packed

__all__ = ["PackedWeight", "is_packed"]

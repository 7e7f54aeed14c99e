"""The ops the model calls through the registry (reference + fast implementations).

`resolve(op, kernels)` returns a callable with the reference's signature; `kernels` is the
run's `KernelConfig` ("auto" picks the best implementation for the backend). `catalog()`
is the table of every op, built on first use.
"""

from hylora.ops.catalog import KERNEL_CHOICE_FIELDS, catalog, resolve
from hylora.ops.registry import AUTO, REFERENCE, OpRegistry

__all__ = ["AUTO", "REFERENCE", "OpRegistry", "catalog", "resolve", "KERNEL_CHOICE_FIELDS"]

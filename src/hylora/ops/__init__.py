"""The ops the model calls through the registry (reference + fast implementations).

`resolve(op, choice)` returns a callable with the reference's signature; `choice` comes
from `KernelConfig` ("auto" picks the best implementation for the backend).
"""

from hylora.ops.catalog import KERNEL_CHOICE_FIELDS, resolve
from hylora.ops.registry import AUTO, REFERENCE, REGISTRY, CheckSpec, OpRegistry

__all__ = ["AUTO", "REFERENCE", "REGISTRY", "CheckSpec", "OpRegistry", "resolve",
           "KERNEL_CHOICE_FIELDS"]

"""How the model runs, apart from what it is.

A model is built from its `ModelConfig` (and the `LoRAConfig` of its adapters) alone.
Two run choices reach it at call time, in this one object carried by `ForwardContext`:
which implementation each registered op uses (`KernelConfig`, see `hylora.ops`) and the
remat policy around each layer (`MemoryConfig`, see `hylora.model.remat_policy`). The
train step makes it from the run's config; a test or notebook may leave the default
(every op on `auto`, remat `full`).
"""

from __future__ import annotations

import dataclasses

from hylora.core.config import KernelConfig, MemoryConfig


@dataclasses.dataclass(frozen=True)
class Execution:
  kernels: KernelConfig = dataclasses.field(default_factory=KernelConfig)
  memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)

"""How the model runs, apart from what it is.

A model is built from its `ModelConfig` (and the `LoRAConfig` of its adapters) alone.
Two run choices reach it at call time, in this one object carried by `ForwardContext`:
which implementation each registered op uses (`KernelConfig`, see `hylora.ops`) and the
remat policy around each layer (`MemoryConfig`, see `hylora.model.remat_policy`). The
train step makes it from the run's config; a test or notebook may leave the default
(every op on `auto`, remat `full`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

from hylora.core.config import KernelConfig, MemoryConfig


@dataclasses.dataclass(frozen=True)
class Execution:
  kernels: KernelConfig = dataclasses.field(default_factory=KernelConfig)
  memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)


_RUNNING: contextvars.ContextVar = contextvars.ContextVar("execution", default=None)


@contextlib.contextmanager
def running(execution: Execution):
  """Within this context (the model's forward), modules that take no `ForwardContext`
  (the linears) run by `execution`."""
  token = _RUNNING.set(execution)
  try:
    yield
  finally:
    _RUNNING.reset(token)


def current() -> Execution:
  """The enclosing forward's `Execution` (the default outside one)."""
  return _RUNNING.get() or Execution()

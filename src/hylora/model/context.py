"""What every layer needs besides its input: document layout, the dropout key, and how
to run (`Execution`: kernel choices and the remat policy)."""

from __future__ import annotations

import jax
from flax import struct

from hylora.model.execution import Execution


@struct.dataclass
class ForwardContext:
  segment_ids: jax.Array  # [B, T] int32: tokens attend only within their segment
  positions: jax.Array  # [B, T] int32: position inside the segment (RoPE)
  dropout_key: jax.Array | None = None  # None: no LoRA dropout (evaluation)
  execution: Execution = struct.field(pytree_node=False, default_factory=Execution)

  def for_layer(self, index) -> "ForwardContext":
    if self.dropout_key is None:
      return self
    return self.replace(dropout_key=jax.random.fold_in(self.dropout_key, index))

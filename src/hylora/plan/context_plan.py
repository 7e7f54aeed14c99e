"""How a run splits its sequences over devices (context parallelism), and what each layer
kind does about it.

The activation rules (meshes.rules) give the batch the mesh axes its rows divide and the
sequence whatever axes are left; where the sequence takes any, each device holds one
contiguous range of every row it holds, and a layer that mixes tokens crosses ranges in
its own way (the schemes below; docs/long_context.md).
"""

from __future__ import annotations

import dataclasses
import math

from hylora.core.config import Config
from meshes import logical_axes as ax
from meshes.per_shard import sequence_axes

# What each token-mixing layer kind exchanges between the ranges of a split sequence.
SCHEMES = {
    "linear": "state scan over ranks",
    "kda": "state scan over ranks",
    "sparse": "gathered keys",
    "mla": "gathered KV latent",
}


@dataclasses.dataclass(frozen=True)
class ContextPlan:
  rows: int  # rows of one micro-batch
  seq_len: int
  axes: tuple[str, ...]  # the mesh axes the sequence is split over
  ranks: int  # ranges of one sequence
  scan_rounds: int  # ppermute rounds of the linear-attention state scan
  schemes: tuple[tuple[str, str], ...]  # (layer kind, what it exchanges)

  @property
  def tokens_per_rank(self) -> int:
    return self.seq_len // self.ranks

  def text(self) -> str:
    rounds = f" ({self.scan_rounds} round{'s' if self.scan_rounds != 1 else ''})"
    kinds = ", ".join(f"{kind}: {scheme}" + (rounds if scheme.startswith("state") else "")
                      for kind, scheme in self.schemes)
    return (f"  sequence: {self.rows} x {self.seq_len} split over {'+'.join(self.axes)}: "
            f"{self.ranks} ranges of {self.tokens_per_rank} tokens; {kinds}")


def context_plan(cfg: Config, mesh_shape: dict) -> ContextPlan | None:
  """The sequence split of cfg's micro-batches on a mesh of `mesh_shape` (None: every
  device holds whole sequences)."""
  from meshes.rules import ACTIVATION_RULES, logical_to_spec
  from types import SimpleNamespace

  t = cfg.train
  rows = max(1, t.batch_size // t.grad_accum)
  spec = logical_to_spec((ax.BATCH, ax.SEQ), (rows, t.seq_len), SimpleNamespace(shape=mesh_shape),
                         ACTIVATION_RULES)
  if spec[1] is None:
    return None
  axes = sequence_axes(spec[1])
  ranks = math.prod(mesh_shape[a] for a in axes)
  kinds = dict.fromkeys(mixer for mixer, _ in cfg.model.layer_kinds() if mixer in SCHEMES)
  return ContextPlan(rows=rows, seq_len=t.seq_len, axes=axes, ranks=ranks,
                     scan_rounds=math.ceil(math.log2(ranks)) if ranks > 1 else 0, schemes=tuple(
                         (kind, SCHEMES[kind]) for kind in kinds))

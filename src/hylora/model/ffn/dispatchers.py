"""The dispatchers `model.moe.dispatch` names: how routed tokens reach their experts.

"auto" is the expert-parallel pipeline, which on one device (or with no mesh) is the
dropless reference itself; a run's plan (hylora.plan.run_plan) prints which one it is."""

from __future__ import annotations

from typing import Callable

from hylora.model.ffn.dispatch import dropless
from hylora.model.ffn.expert_parallel import ep_alltoall

DISPATCHERS: dict[str, Callable] = {
    "auto": ep_alltoall,
    "dropless": dropless,
    "ep_alltoall": ep_alltoall
}


def get_dispatcher(name: str) -> Callable:
  if name not in DISPATCHERS:
    raise ValueError(f"model.moe.dispatch: unknown dispatcher {name!r}; "
                     f"choose one of {sorted(DISPATCHERS)}")
  return DISPATCHERS[name]


def resolved_dispatcher(name: str, devices: int) -> str:
  """The dispatcher "auto" stands for on `devices` devices (other names as given)."""
  if name != "auto":
    return name
  return "ep_alltoall" if devices > 1 else "dropless"

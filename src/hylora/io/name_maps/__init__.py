"""Checkpoint names per model family, as data: one TOML table per family in this folder
(`<family>.toml`), read by loading, checkpoint writing and PEFT export alike. Each table
maps the model's parameter paths to the family's tensor names; the layouts themselves
are the architecture's (`hylora.core.architecture.Tensor`)."""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from importlib import resources

from hylora.core.architecture import DISK_LAYOUTS
from hylora.core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Entry:
  names: tuple[str, ...]  # several: one linear fused along its output
  disk: str | None = None  # overrides the architecture's disk layout


@dataclasses.dataclass(frozen=True)
class NameMap:
  family: str
  layer_prefix: str  # "{layer}" is the global layer index
  model: dict[str, Entry]  # paths from the model's root
  layer: dict[str, Entry]  # paths inside a decoder layer
  vision_prefix: str = ""  # the vision tower's own layout (house family only)

  @property
  def source(self) -> str:
    return f"hylora/io/name_maps/{self.family}.toml"


def families() -> tuple[str, ...]:
  return tuple(
      sorted(
          p.name[:-5] for p in resources.files(__package__).iterdir() if p.name.endswith(".toml")))


def _entry(family: str, path: str, value) -> Entry:
  if isinstance(value, str):
    return Entry((value,))
  if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
    return Entry(tuple(value))
  if isinstance(value, dict) and set(value) <= {"names", "disk"} and "names" in value:
    disk = value.get("disk")
    if disk is not None and disk not in DISK_LAYOUTS:
      raise ConfigError(f"name map {family}: {path!r} has disk layout {disk!r}; known: "
                        f"{sorted(DISK_LAYOUTS)}")
    return dataclasses.replace(_entry(family, path, value["names"]), disk=disk)
  raise ConfigError(f"name map {family}: {path!r} must be a name, a list of names or "
                    f"{{names = [...], disk = ...}}, got {value!r}")


@functools.cache
def name_map(family: str) -> NameMap:
  """The name table of `family`; an unknown family names the known ones."""
  if family not in families():
    raise ConfigError(f"model.family: no checkpoint name map for {family!r}; known: "
                      f"{', '.join(families())}")
  data = tomllib.loads(resources.files(__package__).joinpath(f"{family}.toml").read_text())
  return NameMap(family=family, layer_prefix=data["layer_prefix"], model={
      k: _entry(family, k, v) for k, v in data.get("model", {}).items()
  }, layer={
      k: _entry(family, k, v) for k, v in data.get("layer", {}).items()
  }, vision_prefix=data.get("vision_prefix", ""))

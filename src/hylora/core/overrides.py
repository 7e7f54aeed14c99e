"""Command-line overrides of any config field: `--model.d_model=64`, `--lora.targets=q,v`."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, Iterator

from hylora.core.errors import ConfigError


def iter_fields(cfg, prefix: str = "") -> Iterator[tuple[str, type, Any]]:
  """(dotted name, type, current value) of every leaf field."""
  hints = typing.get_type_hints(type(cfg))
  for f in dataclasses.fields(cfg):
    value = getattr(cfg, f.name)
    name = f"{prefix}{f.name}"
    if dataclasses.is_dataclass(value):
      yield from iter_fields(value, name + ".")
    else:
      yield name, hints[f.name], value


def _parse(name: str, typ, text: str):
  origin = typing.get_origin(typ)
  try:
    if typ is bool:
      low = text.lower()
      if low in ("1", "true", "yes", "on"):
        return True
      if low in ("0", "false", "no", "off"):
        return False
      raise ValueError(text)
    if typ in (int, float, str):
      return typ(text)
    if origin is tuple:
      args = typing.get_args(typ)
      items = [s for s in text.split(",") if s.strip() != ""]
      if len(args) == 2 and args[1] is Ellipsis:
        return tuple(args[0](s.strip()) for s in items)
      if len(items) != len(args):
        raise ValueError(f"expected {len(args)} comma-separated values")
      return tuple(a(s.strip()) for a, s in zip(args, items))
  except ValueError as e:
    raise ConfigError(f"{name}: cannot parse {text!r} as {_type_name(typ)} ({e})") from None
  raise ConfigError(f"{name}: fields of type {typ} cannot be overridden")


def _type_name(typ) -> str:
  return getattr(typ, "__name__", None) or str(typ).replace("typing.", "")


def apply_overrides(cfg, overrides: dict[str, str]):
  """Returns cfg with each dotted field replaced by its parsed value."""
  known = {name: typ for name, typ, _ in iter_fields(cfg)}
  for name, text in overrides.items():
    if name not in known:
      close = [k for k in known if k.split(".")[-1] == name.split(".")[-1]]
      hint = f"; did you mean {close[0]!r}?" if close else "; see --help for the list"
      raise ConfigError(f"unknown config field {name!r}{hint}")
    cfg = _set(cfg, name.split("."), _parse(name, known[name], text))
  return cfg


def _set(cfg, path: list[str], value):
  if len(path) == 1:
    return dataclasses.replace(cfg, **{path[0]: value})
  child = getattr(cfg, path[0])
  return dataclasses.replace(cfg, **{path[0]: _set(child, path[1:], value)})


def split_overrides(argv: list[str]) -> tuple[dict[str, str], list[str]]:
  """Separates `--a.b=v` / `--a.b v` (dotted names) from the other arguments."""
  overrides, rest, i = {}, [], 0
  while i < len(argv):
    arg = argv[i]
    if arg.startswith("--") and "." in arg.split("=", 1)[0]:
      if "=" in arg:
        key, value = arg[2:].split("=", 1)
      else:
        if i + 1 >= len(argv):
          raise ConfigError(f"{arg[2:]}: missing value")
        key, value = arg[2:], argv[i + 1]
        i += 1
      overrides[key] = value
    else:
      rest.append(arg)
    i += 1
  return overrides, rest


def describe(cfg) -> str:
  """One line per overridable field, for --help."""
  lines = []
  for name, typ, value in iter_fields(cfg):
    shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
    lines.append(f"  --{name}={shown}  ({_type_name(typ)})")
  return "\n".join(lines)


def to_dict(cfg) -> dict:
  return json.loads(json.dumps(dataclasses.asdict(cfg)))


def from_dict(cls, data: dict):
  """Rebuilds a (nested) config dataclass from `to_dict` output."""
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for f in dataclasses.fields(cls):
    if f.name not in data:
      continue
    typ, value = hints[f.name], data[f.name]
    if dataclasses.is_dataclass(typ):
      value = from_dict(typ, value)
    elif typing.get_origin(typ) is tuple:
      value = tuple(value)
    kwargs[f.name] = value
  return cls(**kwargs)

"""Conversation and plain-text records from a JSONL file, read by line on demand.

One record per line, either
  {"messages": [{"role": "user", "content": [{"type": "image", "path": "cat.png"},
                                             {"type": "text", "text": "What is this?"}]},
                {"role": "assistant", "content": "A cat."}]}
or {"text": "plain text, trained on every token"}. `content` is a string or a list of
parts; image paths are relative to the JSONL file's folder. Every record is named
`file:line` in errors.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from hylora.core.errors import DataError

ROLES = ("system", "user", "assistant")


@dataclasses.dataclass(frozen=True)
class Part:
  kind: str  # "text" or "image"
  value: str  # the text, or the image's resolved path


@dataclasses.dataclass(frozen=True)
class Message:
  role: str
  parts: tuple[Part, ...]


@dataclasses.dataclass(frozen=True)
class Record:
  where: str  # "file.jsonl:line"
  messages: tuple[Message, ...] | None = None  # a conversation ...
  text: str | None = None  # ... or plain text


def _part(item, where: str, base: Path) -> Part:
  if not isinstance(item, dict) or item.get("type") not in ("text", "image"):
    raise DataError(f'{where}: a content part must be {{"type": "text", "text": ...}} or '
                    f'{{"type": "image", "path": ...}}, got {json.dumps(item)[:80]}')
  if item["type"] == "text":
    if not isinstance(item.get("text"), str):
      raise DataError(f'{where}: a text part needs a string "text"')
    return Part("text", item["text"])
  if not isinstance(item.get("path"), str) or not item["path"]:
    raise DataError(f'{where}: an image part needs a string "path"')
  return Part("image", str(base / item["path"]))


def _message(item, where: str, base: Path) -> Message:
  if not isinstance(item, dict) or item.get("role") not in ROLES:
    raise DataError(f"{where}: every message needs a role in {ROLES}")
  content = item.get("content")
  if isinstance(content, str):
    return Message(item["role"], (Part("text", content),))
  if not isinstance(content, list):
    raise DataError(f"{where}: message content must be a string or a list of parts")
  return Message(item["role"], tuple(_part(p, where, base) for p in content))


def parse_record(line: str, where: str, base: Path) -> Record:
  """One JSONL line -> Record; a DataError naming `where` on any defect."""
  try:
    item = json.loads(line)
  except json.JSONDecodeError as e:
    raise DataError(f"{where}: not valid JSON ({e.msg})") from None
  if not isinstance(item, dict) or not ("messages" in item or "text" in item):
    raise DataError(f'{where}: a record needs "messages" (a conversation) or "text"')
  if "text" in item and "messages" not in item:
    if not isinstance(item["text"], str) or not item["text"].strip():
      raise DataError(f"{where}: record has no text")
    return Record(where, text=item["text"])
  if not isinstance(item["messages"], list) or not item["messages"]:
    raise DataError(f'{where}: "messages" must be a non-empty list')
  messages = tuple(_message(m, where, base) for m in item["messages"])
  texts = [p.value for m in messages for p in m.parts if p.kind == "text"]
  if not any(t.strip() for t in texts):
    raise DataError(f"{where}: record has no text")
  if not any(m.role == "assistant" and any(p.kind == "text" and p.value.strip()
                                           for p in m.parts)
             for m in messages):
    raise DataError(f"{where}: record has no assistant text: nothing to train on")
  return Record(where, messages=messages)


class RecordFile:
  """Random access to the non-blank lines of a JSONL file (what grain's MapDataset
  needs): an index of byte offsets, lines read with pread (safe across threads)."""

  def __init__(self, path: str):
    self.path = Path(path)
    if not self.path.is_file():
      raise DataError(f"train.data: file {path} does not exist")
    offsets, lengths, lines = [], [], []
    with open(self.path, "rb") as f:
      offset = 0
      for number, raw in enumerate(f, 1):
        if raw.strip():
          offsets.append(offset)
          lengths.append(len(raw))
          lines.append(number)
        offset += len(raw)
    if not offsets:
      raise DataError(f"train.data: {path} holds no records")
    self._offsets = np.asarray(offsets, np.int64)
    self._lengths = np.asarray(lengths, np.int64)
    self._lines = np.asarray(lines, np.int64)
    self._fd = os.open(self.path, os.O_RDONLY)

  def __len__(self) -> int:
    return len(self._offsets)

  def __getitem__(self, index: int) -> tuple[str, str]:
    """(where, line text) of record `index`."""
    raw = os.pread(self._fd, int(self._lengths[index]), int(self._offsets[index]))
    where = f"{self.path.name}:{self._lines[index]}"
    try:
      return where, raw.decode("utf-8")
    except UnicodeDecodeError:
      raise DataError(f"{where}: not valid UTF-8") from None

  def __del__(self):
    fd = getattr(self, "_fd", None)
    if fd is not None:
      os.close(fd)


def is_conversation_file(path: str) -> bool:
  """True for a .jsonl file whose first record is a conversation or a text record (a
  .jsonl of token ids belongs to hylora.data.sources.TokenFileSource instead)."""
  p = Path(path)
  if p.suffix != ".jsonl" or not p.is_file():
    return False
  with open(p) as f:
    for line in f:
      if line.strip():
        try:
          item = json.loads(line)
        except json.JSONDecodeError:
          return False
        return isinstance(item, dict) and ("messages" in item or "text" in item)
  return False

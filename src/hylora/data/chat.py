"""The tokenizer (a local tokenizer.json, through the `tokenizers` library) and the chat
template that turns a conversation into token ids.

A turn is `turn_start` + role + "\n" + content + `turn_end` + "\n"; an image part becomes
its tiles' worth of `image` placeholder tokens. Plain-text records end with
`end_of_text`. The special tokens must exist in the tokenizer as single tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tokenizers import Tokenizer

from hylora.core.errors import ConfigError, DataError


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  turn_start: str
  turn_end: str
  image: str  # one placeholder token per image token
  end_of_text: str  # closes a plain-text record


TEMPLATES = {
    "chatml": ChatTemplate("<|im_start|>", "<|im_end|>", "<|image|>", "<|endoftext|>"),
}


def get_template(name: str) -> ChatTemplate:
  if name not in TEMPLATES:
    raise ConfigError(f"train.chat_template: unknown template {name!r}; "
                      f"choose one of {sorted(TEMPLATES)}")
  return TEMPLATES[name]


def find_tokenizer(configured: str, data_path: str) -> str:
  """train.tokenizer, or the tokenizer.json beside the data file."""
  path = Path(configured) if configured else Path(data_path).parent / "tokenizer.json"
  if not path.is_file():
    where = "train.tokenizer" if configured else f"train.tokenizer (unset, looked beside {data_path})"
    raise ConfigError(f"{where}: no tokenizer file at {path}")
  return str(path)


class ChatTokenizer:
  """Text -> ids, plus the ids of the template's special tokens."""

  def __init__(self, path: str, template_name: str, vocab_size: int):
    self.template = get_template(template_name)
    self.vocab_size = vocab_size
    try:
      self.tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # the Rust library raises its own exception types
      raise DataError(f"train.tokenizer: cannot load {path} ({e})") from None
    self.ids = {}
    for field in dataclasses.fields(self.template):
      token = getattr(self.template, field.name)
      token_id = self.tokenizer.token_to_id(token)
      if token_id is None:
        raise DataError(f"train.tokenizer: {path} has no token {token!r} (the "
                        f"{field.name} of train.chat_template={template_name!r})")
      if token_id >= vocab_size:
        raise DataError(f"train.tokenizer: token {token!r} has id {token_id}, outside the "
                        f"model vocabulary [0, {vocab_size})")
      self.ids[field.name] = token_id

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def token_text(self, token_id: int) -> str:
    return self.tokenizer.id_to_token(token_id) or "?"

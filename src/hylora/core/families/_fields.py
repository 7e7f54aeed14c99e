"""Reading config.json fields: typed, with the names of the field at fault."""

from __future__ import annotations

from hylora.core.errors import ConfigError

_MISSING = object()


def field(hf: dict, *keys: str, default=_MISSING):
  """The first of `keys` present in `hf` (families spell the same field differently)."""
  for key in keys:
    if key in hf and hf[key] is not None:
      return hf[key]
  if default is _MISSING:
    raise ConfigError(f"checkpoint config.json: {' / '.join(keys)} is missing "
                      f"(model_type {hf.get('model_type')!r})")
  return default


def require(ok: bool, hf: dict, message: str) -> None:
  if not ok:
    raise ConfigError(f"checkpoint config.json (model_type {hf.get('model_type')!r}): {message}")


def mla_heads(hf: dict) -> int:
  """The attention heads of an MLA model, with the layout rules every MLA family shares:
  one key/value head per query head, untied embeddings, no attention bias."""
  heads = field(hf, "num_attention_heads")
  require(
      field(hf, "num_key_value_heads", default=heads) == heads, hf,
      "num_key_value_heads != num_attention_heads is not an MLA layout")
  require(not field(hf, "tie_word_embeddings", default=False), hf,
          "tied embeddings are not supported")
  require(not field(hf, "attention_bias", default=False), hf, "attention_bias is not supported")
  return heads

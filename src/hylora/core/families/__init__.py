"""Released model families: each reads its checkpoint's `config.json` into the model
config (architecture fields only; how to run it stays the run's choice). A family is this
reader, a name map (`hylora.io.name_maps/<family>.toml`) and the blocks it registers in
`hylora.core.architecture`; `configs/` holds each family's published config at full size
(the presets `kimi-linear`, `deepseek-v3.2`, `kimi-k3`)."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

from hylora.core.config import Config, ModelConfig
from hylora.core.errors import ConfigError
from hylora.core.families import deepseek_v32, kimi_linear

HOUSE_MODEL_TYPE = "hylora_hybrid"  # written by hylora.io.hf_weights.save
# model_type -> the family's reader
READERS = {
    "kimi_linear": kimi_linear,
    "kimi_k3": kimi_linear,  # the K3 wrapper holds a kimi_linear text config
    "deepseek_v32": deepseek_v32,
}
SUPPORTED = tuple(sorted(READERS)) + (HOUSE_MODEL_TYPE,)
HOUSE_KEYS = {"vocab_size": "vocab_size", "d_model": "hidden_size", "layers": "num_hidden_layers"}


def read_config(directory: str | Path) -> dict:
  path = Path(directory) / "config.json"
  if not path.exists():
    raise ConfigError(f"checkpoint.base_weights: {path} is missing (the model's config.json)")
  try:
    return json.loads(path.read_text())
  except ValueError as e:
    raise ConfigError(f"checkpoint.base_weights: {path} is not valid JSON ({e})") from None


def architecture(hf: dict, model: ModelConfig) -> ModelConfig:
  """`model` with every architecture field taken from a checkpoint's config.json."""
  model_type = hf.get("model_type")
  if model_type == HOUSE_MODEL_TYPE:
    from hylora.core.overrides import from_dict
    saved = from_dict(ModelConfig, hf["hylora_model"])
    # the standard keys, where present, are what other tools read and edit: they decide
    standard = {k: hf[v] for k, v in HOUSE_KEYS.items() if v in hf}
    return _with_run_fields(dataclasses.replace(saved, **standard), model)
  if model_type not in READERS:
    raise ConfigError(f"checkpoint.base_weights: config.json has model_type {model_type!r}; "
                      f"supported: {', '.join(SUPPORTED)}")
  return READERS[model_type].architecture(hf, model)


# Model-config fields that say how to run the model, not what it is: a checkpoint's
# config never decides them.
RUN_FIELDS = {
    "": ("weight_dtype", "init_std"),
    "moe": ("aux_loss_weight", "z_loss_weight", "dispatch", "capacity_factor", "transport",
            "overlap_chunks", "aux_loss_kind", "spare_slots", "rebalance_every",
            "bias_update_every", "bias_update_rate"),
    "sparse_attention": ("block_q", "indexer_loss_weight"),
    "mla": ("block_q", "block_k"),
}


def _with_run_fields(saved: ModelConfig, run: ModelConfig) -> ModelConfig:
  out = dataclasses.replace(saved, **{f: getattr(run, f) for f in RUN_FIELDS[""]})
  for section, names in RUN_FIELDS.items():
    if section:
      sub = dataclasses.replace(getattr(out, section),
                                **{f: getattr(getattr(run, section), f) for f in names})
      out = dataclasses.replace(out, **{section: sub})
  return out


def ignored_tensors(hf: dict) -> tuple[str, ...]:
  """Regexes of the tensors a family's checkpoints ship that are not part of the model
  (multi-token-prediction layers, a vision tower of another design)."""
  reader = READERS.get(hf.get("model_type"))
  return reader.ignored_tensors(hf) if reader else ()


def adopt_checkpoint(cfg: Config, directory: str | Path) -> Config:
  """`cfg` with the model architecture of the checkpoint folder `directory`."""
  return dataclasses.replace(cfg, model=architecture(read_config(directory), cfg.model))


def published(name: str) -> dict:
  """A published config.json from `configs/` (the full-size presets)."""
  return json.loads(resources.files(__package__).joinpath("configs", f"{name}.json").read_text())


def mismatch(hf: dict, model: ModelConfig) -> str | None:
  """The first architecture field where `model` differs from the checkpoint's config."""
  want = architecture(hf, model)
  for field in dataclasses.fields(ModelConfig):
    a, b = getattr(model, field.name), getattr(want, field.name)
    if a != b:
      if dataclasses.is_dataclass(a):
        for sub in dataclasses.fields(a):
          if getattr(a, sub.name) != getattr(b, sub.name):
            return f"model.{field.name}.{sub.name}={getattr(b, sub.name)!r}"
      return f"model.{field.name}={b!r}"
  return None

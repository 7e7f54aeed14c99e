"""A checkpoint config's `quantization_config`, read into `model.quantization`: the
packed format the released base ships in and the modules it keeps in bf16.

  quant_method "fp8", fmt e4m3 / float8_e4m3fn, weight_block_size [128, 128]
      -> "fp8_block" (DeepSeek-V3/V3.2, Kimi K2, MiniMax-M2); `modules_to_not_convert`
         (transformers' rule: a name matched from the start, or a name's tail) -> ignore
  quant_method "compressed-tensors", format "mxfp4-pack-quantized"
      -> "mxfp4" (Kimi K3's routed experts)
  quant_method "compressed-tensors", format "pack-quantized", 4-bit symmetric int
  weights in groups of 32 -> "int4" (Kimi K2-Thinking)

compressed-tensors' `ignore` is copied as it is: exact module names, or "re:REGEX"
matched from the start of the module name. Anything else is a one-line ConfigError
naming the field, its value and what is supported.
"""

from __future__ import annotations

import re

from hylora.core.config import QuantizationConfig
from hylora.core.errors import ConfigError

FP8_FMTS = ("e4m3", "float8_e4m3fn")
COMPRESSED_FORMATS = {"mxfp4-pack-quantized": "mxfp4", "pack-quantized": "int4"}
SUPPORTED = ("fp8 (fmt e4m3, weight_block_size [128, 128]); compressed-tensors "
             "(mxfp4-pack-quantized; pack-quantized with 4-bit symmetric int weights in groups "
             "of 32)")


def _refuse(field: str, value, supported: str) -> ConfigError:
  return ConfigError(f"checkpoint config.json: quantization_config.{field} is {value!r}; "
                     f"supported: {supported}")


def quantization(hf: dict) -> QuantizationConfig:
  """The packed format of a checkpoint's config (format "none" without a
  `quantization_config`)."""
  qc = hf.get("quantization_config")
  if not qc:
    return QuantizationConfig()
  if not isinstance(qc, dict):
    raise ConfigError(f"checkpoint config.json: quantization_config is {qc!r}; expected a table")
  method = qc.get("quant_method")
  if method == "fp8":
    return _fp8(qc)
  if method == "compressed-tensors":
    return _compressed(qc)
  raise _refuse("quant_method", method, SUPPORTED)


def _fp8(qc: dict) -> QuantizationConfig:
  fmt = qc.get("fmt", "e4m3")
  if fmt not in FP8_FMTS:
    raise _refuse("fmt", fmt, " / ".join(FP8_FMTS))
  block = qc.get("weight_block_size")
  if list(block or []) != [128, 128]:
    raise _refuse("weight_block_size", block, "[128, 128]")
  return QuantizationConfig(
      "fp8_block", tuple(_not_converted(m) for m in qc.get("modules_to_not_convert") or ()))


def _not_converted(name: str) -> str:
  """transformers skips a module whose name matches `name` from the start (as a regex) or
  ends with it: the same as one ignore regex."""
  return f"re:(?:{name}|.*{re.escape(name)}$)"


def _compressed(qc: dict) -> QuantizationConfig:
  fmt = qc.get("format")
  if fmt not in COMPRESSED_FORMATS:
    raise _refuse("format", fmt, ", ".join(COMPRESSED_FORMATS) + " (compressed-tensors)")
  status = qc.get("quantization_status", "compressed")
  if status != "compressed":
    raise _refuse("quantization_status", status, "compressed (weights stored packed)")
  name = COMPRESSED_FORMATS[fmt]
  kind = "float" if name == "mxfp4" else "int"
  for group, scheme in (qc.get("config_groups") or {}).items():
    _check_group(f"config_groups.{group}", scheme or {}, kind, needs_symmetric=name == "int4")
  if name == "int4" and not qc.get("config_groups"):
    raise _refuse("config_groups", None, "a group of 4-bit symmetric int weights, group_size 32")
  ignore = qc.get("ignore") or ()
  if isinstance(ignore, str) or not all(isinstance(e, str) for e in ignore):
    raise _refuse("ignore", ignore, "a list of module names or 're:REGEX' entries")
  return QuantizationConfig(name, tuple(ignore))


def _check_group(where: str, scheme: dict, kind: str, needs_symmetric: bool) -> None:
  targets = scheme.get("targets", ["Linear"])
  if list(targets) != ["Linear"]:
    raise _refuse(f"{where}.targets", targets, "['Linear'] (modules kept in bf16 go in `ignore`)")
  for side in ("input_activations", "output_activations"):
    if scheme.get(side):
      raise _refuse(f"{where}.{side}", scheme[side], "null (weight-only quantization)")
  weights = scheme.get("weights")
  if not isinstance(weights, dict):
    raise _refuse(f"{where}.weights", weights, "a weight scheme")
  want = {"num_bits": 4, "type": kind, "group_size": 32}
  if needs_symmetric:
    want["symmetric"] = True
  for key, value in want.items():
    if weights.get(key) != value:
      raise _refuse(f"{where}.weights.{key}", weights.get(key), repr(value))
  strategy = weights.get("strategy", "group")
  if strategy not in ("group", "tensor_group"):
    raise _refuse(f"{where}.weights.strategy", strategy, "group")
  if weights.get("actorder"):
    raise _refuse(f"{where}.weights.actorder", weights["actorder"], "null")

"""The model split into what trains (LoRA factors) and what stays frozen (everything
else), built directly into its shardings: no device ever holds more than its shard."""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx

from hylora.core.config import Config
from hylora.model import HybridLM, LoRAParam
from hylora.model.init import ParamInit
from hylora.io.packed_scheme import pack_template, pack_values
from meshes.rules import state_shardings


@dataclasses.dataclass(frozen=True)
class ModelParts:
  """Static pieces needed to rebuild the model from its two pytrees."""

  graphdef: nnx.GraphDef
  lora_template: nnx.State  # abstract
  frozen_template: nnx.State  # abstract
  min_shard_size: int = 0

  def merge(self, lora: dict, frozen: dict) -> HybridLM:
    return nnx.merge(self.graphdef, _filled(self.lora_template, lora),
                     _filled(self.frozen_template, frozen))


def _filled(template: nnx.State, values: dict) -> nnx.State:
  state = jax.tree.map(lambda x: x, template)  # a fresh copy: the template stays abstract
  nnx.replace_by_pure_dict(state, values)
  return state


def _build(cfg: Config, seed: int) -> HybridLM:
  return HybridLM(cfg.model, cfg.lora, init=ParamInit(seed))


def model_parts(cfg: Config, seed: int = 0) -> ModelParts:
  return _model_parts(cfg.model, cfg.lora, seed, cfg.mesh.min_shard_size)


# Building the abstract model takes seconds and the plan, the trainer, the step and the
# checkpoint loader each ask for it; the parts depend on these fields alone, and nothing
# changes them in place (`ModelParts.merge` fills copies of the templates).
@functools.lru_cache(maxsize=16)
def _model_parts(model, lora, seed: int, min_shard_size: int) -> ModelParts:
  cfg = Config(model=model, lora=lora)
  abstract = nnx.eval_shape(lambda: _build(cfg, seed))
  graphdef, lora_state, frozen = nnx.split(abstract, LoRAParam, ...)
  # kernels the checkpoint ships packed stay packed (hylora.io.packed_scheme)
  return ModelParts(graphdef, lora_state, pack_template(cfg, frozen), min_shard_size)


def shardings(parts: ModelParts, mesh) -> tuple[dict, dict]:
  """NamedShardings (pure-dict pytrees) for the LoRA and frozen pytrees."""
  floor = parts.min_shard_size
  return (nnx.to_pure_dict(state_shardings(parts.lora_template, mesh, min_shard_size=floor)),
          nnx.to_pure_dict(state_shardings(parts.frozen_template, mesh, min_shard_size=floor)))


def abstract_arrays(parts: ModelParts, mesh=None) -> tuple[dict, dict]:
  """ShapeDtypeStructs (with shardings when a mesh is given) of both pytrees."""
  lora, frozen = nnx.to_pure_dict(parts.lora_template), nnx.to_pure_dict(parts.frozen_template)
  if mesh is None:
    return lora, frozen
  lora_sh, frozen_sh = shardings(parts, mesh)
  attach = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
  return jax.tree.map(attach, lora, lora_sh), jax.tree.map(attach, frozen, frozen_sh)


def init_params(cfg: Config, parts: ModelParts, mesh, seed: int = 0) -> tuple[dict, dict]:
  """Random base weights and fresh adapters, created sharded (kernels the checkpoint
  format packs: the random bf16 values quantized)."""
  lora_sh, frozen_sh = shardings(parts, mesh)

  @jax.jit
  def make():
    _, lora, frozen = nnx.split(_build(cfg, seed), LoRAParam, ...)
    return nnx.to_pure_dict(lora), pack_values(cfg, nnx.to_pure_dict(frozen))

  return jax.jit(make, out_shardings=(lora_sh, frozen_sh))()

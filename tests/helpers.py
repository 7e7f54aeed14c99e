"""Small configurations shared by the tests."""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx

from hylora.core.config import Config, MeshConfig
from hylora.model import HybridLM
from hylora.model.init import ParamInit
from hylora.core.presets import tiny


def small_config(**train) -> Config:
  """The tiny preset cut to one `L L L S` period (one dense layer), short rows."""
  cfg = tiny()
  # One program for the routed experts, as most tests want; the expert-parallel
  # dispatcher that `auto` picks on a mesh has its own tests.
  model = dataclasses.replace(cfg.model, layers=4, dense_layers=1,
                              moe=dataclasses.replace(cfg.model.moe, dispatch="dropless"))
  return dataclasses.replace(
      cfg, model=model, mesh=MeshConfig(fsdp=2, expert=4),
      train=dataclasses.replace(cfg.train, seq_len=64, batch_size=8, **train))


def two_layer_config(**train) -> Config:
  """small_config() with one layer of each kind: linear attention with the dense FFN,
  sparse attention with the MoE. Half the compile, for tests whose property does not
  depend on depth (tests/cli_runs.py runs the command on it)."""
  cfg = small_config(**train)
  return dataclasses.replace(
      cfg, model=dataclasses.replace(cfg.model, layers=2, pattern=("linear", "sparse"),
                                     dense_layers=1))


@functools.cache
def _small_model_parts():
  build = lambda: HybridLM(small_config().model, small_config().lora, init=ParamInit(0))
  graphdef, _ = nnx.split(nnx.eval_shape(build))
  # One compiled initialiser rather than hundreds of eager ones; built once per process,
  # and the tests that use it share its compile through the persistent cache.
  return graphdef, jax.jit(lambda: nnx.split(build())[1])()


def small_model() -> HybridLM:
  """HybridLM(small_config().model, small_config().lora, init=ParamInit(0)): its initial weights (B factors zero),
  as a fresh module over shared arrays."""
  graphdef, state = _small_model_parts()
  return nnx.merge(graphdef, jax.tree.map(lambda x: x, state))


FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures" / "hf"


def fixture_config(family: str) -> dict:
  """The config.json of a released family's tiny fixture (tests/fixtures/hf)."""
  import json
  return json.loads((FIXTURES / family / "config.json").read_text())


def tiny_k3_config(layers: int | None = None) -> dict:
  """The Kimi Linear fixture's config with Kimi K3's fields: full-rank KDA output gate,
  decay lower bound, low-rank q and output gate in MLA, latent MoE, SiTU-GLU, block
  attention residuals (two layers per block over five layers). With `layers`, its first
  layers only: 3 keeps every K3 layer kind (KDA, KDA, gated MLA; a dense FFN, then latent
  experts) at a third less compile than five."""
  text = fixture_config("kimi_linear")
  text["linear_attn_config"] = dict(text["linear_attn_config"], gate_lower_bound=-5.0,
                                    use_full_rank_gate=True)
  if layers is not None:
    kinds = text["layer_types"][:layers]
    text["linear_attn_config"].update(
        kda_layers=[i + 1 for i, kind in enumerate(kinds) if kind == "linear_attention"],
        full_attn_layers=[i + 1 for i, kind in enumerate(kinds) if kind == "full_attention"])
    text.update(num_hidden_layers=layers, mlp_layer_types=text["mlp_layer_types"][:layers])
  text.pop("layer_types", None)
  text.update(q_lora_rank=24, mla_use_output_gate=True, routed_expert_hidden_size=48,
              hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
              attn_res_block_size=2, num_shared_experts=2)
  return {"model_type": "kimi_k3", "text_config": text}


def released_config(hf: dict) -> Config:
  """small_config() run settings with the architecture of a config.json."""
  from hylora.core import families
  from hylora.core.presets import RELEASED_LORA
  cfg = small_config()
  cfg = dataclasses.replace(cfg, lora=dataclasses.replace(RELEASED_LORA, rank=4, alpha=8.0))
  return dataclasses.replace(cfg, model=families.architecture(hf, cfg.model))


def token_batch(cfg: Config, mesh, documents: int = 1) -> dict:
  """A random train batch of cfg's shape, each row `documents` equal documents (the last
  label of a row ignored), sharded over every device along the batch."""
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from hylora.model import IGNORE_INDEX
  from hylora.train.step import BATCH_KEYS

  b, t = cfg.train.batch_size, cfg.train.seq_len
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.model.vocab_size, (b, t)).astype(np.int32)
  labels = np.roll(tokens, -1, axis=1)
  labels[:, -1] = IGNORE_INDEX
  document = np.arange(t) * documents // t
  arrays = {
      "tokens":
          tokens,
      "labels":
          labels,
      "segment_ids":
          np.broadcast_to(document + 1, (b, t)).astype(np.int32),
      "positions":
          np.broadcast_to(np.arange(t) - document * (t // documents), (b, t)).astype(np.int32)
  }
  sharding = NamedSharding(mesh, P(("fsdp", "expert")))
  return {k: jax.device_put(arrays[k], sharding) for k in BATCH_KEYS}


def loss_and_lora_grads(cfg: Config, mesh, lora: dict, frozen: dict, batch: dict):
  """(mean token loss, gradient of every LoRA factor) of one step's objective, compiled
  whole, under `mesh`'s activation rules (None: no mesh)."""
  import jax.numpy as jnp

  from hylora.train import state as st
  from hylora.train.step import make_loss_fn
  from meshes.rules import activation_mesh

  objective = jax.value_and_grad(make_loss_fn(cfg, st.model_parts(cfg)), has_aux=True)

  @jax.jit
  def run(lora, frozen, batch):
    with activation_mesh(mesh):
      (_, info), grads = objective(lora, frozen, batch, jnp.sum(batch["labels"] >= 0), None)
    return info["loss_sum"] / info["tokens"], grads

  return jax.device_get(run(lora, frozen, batch))

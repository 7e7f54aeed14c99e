"""The sharded LoRA train step: gradient accumulation over micro-batches, AdamW on the
adapters only, auxiliary MoE losses, and per-step metrics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from hylora.core.config import Config
from hylora.model import IGNORE_INDEX, Execution
from hylora.train import expert_sites
from hylora.train.state import ModelParts

BATCH_KEYS = ("tokens", "labels", "segment_ids", "positions")
IMAGE_KEYS = ("images", "image_positions")  # optional: [rows, tiles, ...] per-row image batches


def _moe_layer_count(cfg: Config) -> int:
  return max(1, sum(ffn == "moe" for _, ffn in cfg.model.layer_kinds()))


def make_loss_fn(cfg: Config, parts: ModelParts):
  """objective(lora, frozen, micro_batch, total_tokens, dropout_key) -> (objective, info).

  The objective is this micro-batch's share of the step's loss: token losses summed
  and divided by the step's total count, so accumulated gradients equal the gradient of
  the whole batch exactly."""
  moe_layers = _moe_layer_count(cfg)
  moe, accum = cfg.model.moe, cfg.train.grad_accum
  indexer_weight = cfg.model.sparse_attention.indexer_loss_weight
  execution = Execution(kernels=cfg.kernels, memory=cfg.memory)

  def objective(lora, frozen, batch, total_tokens, dropout_key):
    model = parts.merge(lora, frozen)
    loss_sum, count, aux = model.loss_terms(batch, dropout_key, execution)
    aux_loss = jnp.sum(aux["moe_aux_loss"]) / moe_layers
    z_loss = jnp.sum(aux["moe_z_loss"]) / moe_layers
    indexer_kl = jnp.mean(aux["indexer_kl"])
    extra = moe.aux_loss_weight * aux_loss + moe.z_loss_weight * z_loss
    extra = extra + indexer_weight * indexer_kl
    obj = loss_sum / jnp.maximum(total_tokens, 1) + extra / accum
    info = {
        "loss_sum": loss_sum,
        "tokens": count,
        "moe_aux_loss": aux_loss,
        "moe_z_loss": z_loss,
        "expert_load": aux["expert_load"],
        "dropped_tokens": jnp.sum(aux["dropped_tokens"]),
        "all_to_all_rounds": jnp.max(aux["all_to_all_rounds"]),
    }
    return obj, info

  return objective


def make_train_step(cfg: Config, parts: ModelParts, optimizer: optax.GradientTransformation,
                    schedule=None):
  """train_step(lora, opt_state, frozen, batch, step) -> (lora, opt_state, metrics).

  batch arrays are [global_batch, seq]; they are split into `grad_accum` micro-batches."""
  objective = make_loss_fn(cfg, parts)
  grad_fn = jax.value_and_grad(objective, has_aux=True)
  accum, seed, dropout = cfg.train.grad_accum, cfg.train.seed, cfg.lora.dropout
  moe = cfg.model.moe
  k = moe.top_k
  # Spare slots hold copies of experts whose LoRA factors must stay equal.
  sites = (expert_sites.find_sites(cfg, nnx.to_pure_dict(parts.frozen_template))
           if moe.slots > moe.experts else [])

  def train_step(lora, opt_state, frozen, batch, step):
    total = jnp.sum(batch["labels"] != IGNORE_INDEX)
    # Micro-batch i takes rows i, i + accum, ...: each one stays spread over all devices.
    micro = {
        key: batch[key].reshape(-1, accum, *batch[key].shape[1:]).swapaxes(0, 1)
        for key in BATCH_KEYS + IMAGE_KEYS
        if key in batch
    }
    step_key = jax.random.fold_in(jax.random.key(seed), step) if dropout > 0 else None

    def one(carry, xs):
      grads, = carry
      mb, index = xs
      key = None if step_key is None else jax.random.fold_in(step_key, index)
      (_, info), g = grad_fn(lora, frozen, mb, total, key)
      return (jax.tree.map(jnp.add, grads, g),), info

    zeros = jax.tree.map(jnp.zeros_like, lora)
    (grads,), infos = jax.lax.scan(one, (zeros,), (micro, jnp.arange(accum)))
    if sites:
      tables = expert_sites.tables(frozen, sites)
      grads = expert_sites.tie_replica_grads(grads, tables, moe.experts)
    updates, new_opt_state = optimizer.update(grads, opt_state, lora)
    new_lora = optax.apply_updates(lora, updates)
    if sites:
      new_lora = expert_sites.refresh_replicas(new_lora, tables, moe.experts)
    tokens = jnp.sum(infos["tokens"])
    loss = jnp.sum(infos["loss_sum"]) / jnp.maximum(tokens, 1)
    grad_norm = optax.global_norm(grads)
    # A non-finite loss or gradient skips the update: parameters and optimizer state
    # (its step count included) stay as they were; the run counts and limits these.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jnp.where(finite, new, old)
    lora = jax.tree.map(keep, new_lora, lora)
    opt_state = jax.tree.map(keep, new_opt_state, opt_state)

    load = jnp.sum(infos["expert_load"], axis=0)  # [layers, experts]; dense layers: zeros
    busiest = jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9)
    # A Python float: at the 2p8t shape the count (2.3e9) overflows int32.
    routed_pairs = float(batch["tokens"].size * k * _moe_layer_count(cfg))
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "skipped": (~finite).astype(jnp.float32),
        "moe_aux_loss": jnp.mean(infos["moe_aux_loss"]),
        "moe_z_loss": jnp.mean(infos["moe_z_loss"]),
        "expert_load_max_over_mean": jnp.max(busiest),
        "dropped_fraction": jnp.sum(infos["dropped_tokens"]) / routed_pairs,
        "all_to_all_rounds": jnp.max(infos["all_to_all_rounds"]),
        "tokens": tokens,
        "expert_load": load,  # [layers, experts]: the run's balancer reads it (not logged as is)
    }
    if schedule is not None:
      metrics["learning_rate"] = schedule(step)
    return lora, opt_state, metrics

  return train_step

"""Everything a run needs, built once: mesh-aware shardings, the compiled train step,
sharded parameters and optimizer state, and the batch placement."""

from __future__ import annotations

import hashlib
import time

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from hylora.core.config import Config
from hylora.core.errors import ConfigError
from hylora.model.ffn import expert_parallel
from hylora.train import state as st
from hylora.train.optimizer import learning_rate_schedule, make_optimizer
from hylora.train.step import BATCH_KEYS, IMAGE_KEYS, make_train_step
from meshes.rules import ACTIVATION_RULES, activation_mesh, logical_to_spec


def check_model_fits_mesh(cfg: Config, mesh: jax.sharding.Mesh) -> None:
  moe, ep = cfg.model.moe, mesh.shape["expert"]
  if moe.slots % ep:
    spare = f" + {moe.spare_slots} spare slots" if moe.spare_slots else ""
    field = "model.moe.spare_slots" if moe.spare_slots else "model.moe.experts"
    raise ConfigError(f"{field}: {moe.experts} experts{spare} cannot be split evenly over the "
                      f"expert mesh axis of size {ep} (mesh.expert)")


class Trainer:

  def __init__(self, cfg: Config, mesh: jax.sharding.Mesh, plan=None):
    """`plan`: the run's resolved choices (hylora.plan.run_plan.RunPlan); the step is then
    built from `plan.apply(cfg)`. Without one, "auto" choices resolve at trace time
    (the expert-parallel dispatcher, `full` remat)."""
    self.plan = plan
    cfg = plan.apply(cfg) if plan is not None else cfg
    check_model_fits_mesh(cfg, mesh)
    self.cfg, self.mesh = cfg, mesh
    self.parts = st.model_parts(cfg, cfg.train.seed)
    self.lora_sharding, self.frozen_sharding = st.shardings(self.parts, mesh)
    self.schedule = learning_rate_schedule(cfg.train)
    self.optimizer = make_optimizer(cfg.train)
    spec = logical_to_spec(("batch", "seq"), (cfg.train.batch_size, cfg.train.seq_len), mesh,
                           ACTIVATION_RULES)
    self.batch_sharding = NamedSharding(mesh, spec)
    self._step_fn = make_train_step(cfg, self.parts, self.optimizer, self.schedule)
    self.compiled = None
    self.compile_seconds = 0.0
    self.program_fingerprint = ""

  def init(self, seed: int | None = None, base_weights: str = ""):
    """(lora, opt_state, frozen), all sharded over the mesh; with `base_weights` (an
    HF-layout folder, hylora.io.hf_weights) the frozen weights are read from it."""
    seed = self.cfg.train.seed if seed is None else seed
    if base_weights:
      lora, frozen = self.load_base(base_weights, seed)
    else:
      lora, frozen = st.init_params(self.cfg, self.parts, self.mesh, seed)
    opt_state = self.init_optimizer(lora)
    return lora, opt_state, frozen

  def load_base(self, directory: str, seed: int):
    from hylora.io import hf_weights

    # Fresh adapters only: the random base weights of init_params are dead code here.
    make = lambda: st.init_params(self.cfg, self.parts, self.mesh, seed)[0]
    lora = jax.jit(make, out_shardings=self.lora_sharding)()
    _, frozen_abstract = st.abstract_arrays(self.parts, self.mesh)
    frozen, lora = hf_weights.load(directory, self.cfg, frozen_abstract, lora)
    return lora, frozen

  def optimizer_sharding(self, lora):
    """Moments sharded like the adapters; counters and scalars replicated."""
    abstract = jax.eval_shape(self.optimizer.init, lora)
    replicated = NamedSharding(self.mesh, P())
    return optax.tree_map_params(self.optimizer, lambda _, sharding: sharding, abstract,
                                 self.lora_sharding, transform_non_params=lambda _: replicated)

  def init_optimizer(self, lora):
    return jax.jit(self.optimizer.init, out_shardings=self.optimizer_sharding(lora))(lora)

  def key_sharding(self, key: str) -> NamedSharding:
    """Token arrays [rows, seq]; image arrays [rows, tiles, ...]: split by rows only."""
    if key in IMAGE_KEYS:
      return NamedSharding(self.mesh, P(self.batch_sharding.spec[0]))
    return self.batch_sharding

  def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {
        k: jax.make_array_from_process_local_data(self.key_sharding(k), batch[k])
        for k in BATCH_KEYS + IMAGE_KEYS
        if k in batch
    }

  def jitted_step(self, opt_state, batch_keys=BATCH_KEYS):
    opt_sharding = jax.tree.map(lambda a: a.sharding, opt_state)

    def step(lora, opt_state, frozen, batch, step):
      with activation_mesh(self.mesh):
        return self._step_fn(lora, opt_state, frozen, batch, step)

    batch_sh = {k: self.key_sharding(k) for k in batch_keys}
    return jax.jit(
        step,
        in_shardings=(self.lora_sharding, opt_sharding, self.frozen_sharding, batch_sh, None),
        # metrics replicated: every process reads them (and the expert load)
        out_shardings=(self.lora_sharding, opt_sharding, NamedSharding(self.mesh, P())),
        donate_argnums=(0, 1))

  def compile(self, lora, opt_state, frozen, batch):
    start = time.perf_counter()
    step = jax.ShapeDtypeStruct((), np.int32)
    options = expert_parallel.xla_options(self.cfg.model.moe, self.mesh.devices.flat[0].platform)
    lowered = self.jitted_step(opt_state, tuple(batch)).lower(lora, opt_state, frozen, batch, step)
    # What XLA is given (compile flags aside): a dry run and the run it stands for agree.
    self.program_fingerprint = hashlib.sha256(lowered.as_text().encode()).hexdigest()[:16]
    self.compiled = lowered.compile(options)
    self.compile_seconds = time.perf_counter() - start
    return self.compiled

  def step(self, lora, opt_state, frozen, batch, step: int):
    if self.compiled is None:
      self.compile(lora, opt_state, frozen, batch)
    return self.compiled(lora, opt_state, frozen, batch, np.int32(step))

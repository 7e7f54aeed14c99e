"""The fp32 logits of a Hugging Face checkpoint folder as this stack loads it.

  python -m experiments.hf_logits --base-weights DIR --input-ids IDS.npy --out LOGITS.npy

DIR is a released checkpoint (config.json with a supported `model_type`, safetensors
shards or one file, optionally model.safetensors.index.json) or one this stack wrote.
IDS.npy holds int token ids [B, T]; LOGITS.npy receives fp32 logits [B, T, V], computed in
fp32 with the reference kernels on one device (any backend; CPU is the default here).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

from hylora.core.config import Config, KernelConfig, LoRAConfig, MeshConfig
from hylora.core.errors import ConfigError, WeightsError


def checkpoint_config(directory: str, ignore_tensors: str = "") -> Config:
  """A one-device, fp32, reference-kernel config whose model is the checkpoint's."""
  from hylora.core import families
  base = Config()
  model = dataclasses.replace(base.model, weight_dtype="float32",
                              vision=dataclasses.replace(base.model.vision, enabled=False),
                              moe=dataclasses.replace(base.model.moe, dispatch="dropless"))
  cfg = dataclasses.replace(
      base, preset="checkpoint", model=model, lora=LoRAConfig(targets=()),
      mesh=MeshConfig(fsdp=1, expert=1),
      kernels=KernelConfig(**{f.name: "reference" for f in dataclasses.fields(KernelConfig)}),
      checkpoint=dataclasses.replace(base.checkpoint, base_weights=str(directory),
                                     ignore_tensors=ignore_tensors))
  return families.adopt_checkpoint(cfg, directory)


def logits(directory: str, input_ids: np.ndarray, ignore_tensors: str = "") -> np.ndarray:
  """fp32 logits [B, T, V] of the checkpoint in `directory` for token ids [B, T]."""
  import jax
  import jax.numpy as jnp

  from hylora.io import hf_weights
  from hylora.model.context import ForwardContext
  from hylora.model.execution import Execution
  from hylora.train import state as st
  from meshes.mesh import AXES

  ids = np.asarray(input_ids)
  if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
    raise ConfigError(f"--input-ids: want integer token ids [B, T], got {ids.dtype} {ids.shape}")
  cfg = checkpoint_config(directory, ignore_tensors)
  if ids.min() < 0 or ids.max() >= cfg.model.vocab_size:
    raise ConfigError(f"--input-ids: ids must be in [0, {cfg.model.vocab_size}), got "
                      f"[{ids.min()}, {ids.max()}]")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), AXES)
  parts = st.model_parts(cfg)
  lora_abstract, frozen_abstract = st.abstract_arrays(parts, mesh)
  frozen, _ = hf_weights.load(directory, cfg, frozen_abstract)
  lora = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), lora_abstract)
  b, t = ids.shape
  ctx = ForwardContext(jnp.zeros((b, t), jnp.int32),
                       jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), None,
                       Execution(kernels=cfg.kernels))

  @jax.jit
  def forward(lora, frozen, tokens):
    return parts.merge(lora, frozen).logits(tokens, ctx)

  return np.asarray(forward(lora, frozen, jnp.asarray(ids, jnp.int32)), np.float32)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--base-weights", required=True, help="the checkpoint folder")
  p.add_argument("--input-ids", required=True, help=".npy of int token ids [B, T]")
  p.add_argument("--out", required=True, help=".npy to write the fp32 logits [B, T, V] to")
  p.add_argument("--ignore-tensors", default="",
                 help="regex of checkpoint tensors that are not part of the model")
  args = p.parse_args(argv)
  try:
    out = logits(args.base_weights, np.load(args.input_ids), args.ignore_tensors)
  except (ConfigError, WeightsError, OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  np.save(args.out, out)
  print(f"{args.out}: logits {list(out.shape)}, max |logit| {np.abs(out).max():.4g}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

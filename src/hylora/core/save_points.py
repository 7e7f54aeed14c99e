"""The one vocabulary of remat save-point names, and `checkpoint_name` for them.

Every matmul / grouped-matmul output and block boundary that a memory policy may keep
is tagged with one of these names (see `hylora.model.remat_policy` for the policies).
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels import residuals as kernel_residuals

LAYER_INPUT = "layer_input"  # the residual stream entering a layer
MIXER_NORM = "mixer_norm"  # normalised input of the attention mixer
QKV = "qkv"  # q, k, v projections (both attention kinds)
GATES = "gates"  # low-rank gate projections (decay, output gate, beta)
INDEXER = "indexer"  # indexer queries / keys / weights of the sparse layers
TOPK = "topk_indices"  # the indexer's chosen keys per query (int32; costly to recompute)
# the attention core's output (before the output projection) and what its kernels keep
# for their backward (pallas_kernels/residuals.py tags those with this very name)
ATTENTION = kernel_residuals.NAME
MIXER_OUT = "mixer_out"  # output projection of the mixer
FFN_NORM = "ffn_norm"  # normalised input of the FFN
ROUTER = "router"  # router logits
EXPERT_INPUT = "expert_input"  # token rows as they reach the routed experts (after dispatch)
MLP_GATE_UP = "mlp_gate_up"  # dense / shared-expert gate_up output
MLP_DOWN = "mlp_down"  # dense / shared-expert down output
EXPERT_GATE_UP = "expert_gate_up"  # routed experts' grouped gate_up output
EXPERT_DOWN = "expert_down"  # routed experts' grouped down output
LORA_A = "lora_a"  # x @ A of the adapters

ALL = (LAYER_INPUT, MIXER_NORM, QKV, GATES, INDEXER, TOPK, ATTENTION, MIXER_OUT, FFN_NORM, ROUTER,
       MLP_GATE_UP, MLP_DOWN, EXPERT_INPUT, EXPERT_GATE_UP, EXPERT_DOWN, LORA_A)


def tag(x: jax.Array, name: str) -> jax.Array:
  if name not in ALL:
    raise ValueError(f"unknown save point {name!r}; known: {ALL}")
  return checkpoint_name(x, name)

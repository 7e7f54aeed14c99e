"""One table of every registered op: its reference and its fast implementations.

References live beside their kernels in `pallas_kernels/<family>/reference.py`; both are
named by import path and imported only when used.
"""

from __future__ import annotations

import functools

from hylora.core.config import KernelConfig
from hylora.ops.registry import AUTO, REFERENCE, OpRegistry

_LA = "pallas_kernels.linear_attention"
_SA = "pallas_kernels.sparse_attention"
_GMM = "pallas_kernels.grouped_matmul"
_CE = "pallas_kernels.cross_entropy"
_RM = "pallas_kernels.residual_mix"
_CA = "pallas_kernels.causal_attention"
_QMM = "pallas_kernels.quantized_matmul"
_SC = "pallas_kernels.short_conv"

PER_DEVICE_REFERENCE = "reference_per_device"
_PER_DEVICE_REFERENCES = {
    "linear_attention.gla": "linear_recurrence",
    "linear_attention.kda": "linear_recurrence",
    "sparse_attention.topk_indices": "indexer",
    "sparse_attention.attend": "sparse_attention",
    "attention.causal": "rows",
}


@functools.cache
def catalog() -> OpRegistry:
  """Every op with its reference and fast implementations, built once on first use."""
  registry = OpRegistry()
  registry.define("linear_attention.gla", f"{_LA}.reference:gla_chunked")
  registry.define("linear_attention.kda", f"{_LA}.reference:kda_chunked")
  registry.define("sparse_attention.topk_indices", f"{_SA}.reference:topk_indices_reference")
  registry.define("sparse_attention.attend", f"{_SA}.reference:sparse_attention_reference")
  registry.define("attention.causal", f"{_CA}.reference:causal_attention_reference")
  registry.define("grouped_matmul", f"{_GMM}.reference:grouped_matmul_reference")
  registry.define("grouped_lora", f"{_GMM}.reference:grouped_lora_reference")
  registry.define("quantized_matmul", f"{_QMM}.reference:quantized_matmul_reference")
  registry.define("quantized_grouped_matmul",
                  f"{_QMM}.reference:quantized_grouped_matmul_reference")
  registry.define("cross_entropy", f"{_CE}.reference:cross_entropy_reference")
  registry.define("rms_norm", "hylora.model.norms:rms_norm")
  registry.define("residual_mix", f"{_RM}.reference:residual_mix_reference")  # docs/day_one.md
  registry.define("short_conv", f"{_SC}.reference:short_conv_silu_reference")

  # Fast paths. "auto" takes the highest priority registered for the backend; an impl
  # below the reference's priority (-1) runs only when named in KernelConfig. The
  # measurements behind each priority: docs/performance.md.
  # The attention kernels act on each sequence alone: per device on its batch rows; where
  # the sequence is split too, the linear ones pass their state between devices and the
  # sparse ones gather the keys (meshes.split_recurrence, meshes.gathered_keys).
  registry.register("linear_attention.gla", "pallas", f"{_LA}:chunked_gla", backends=("gpu",),
                    per_shard="linear_recurrence")
  registry.register("linear_attention.kda", "pallas", f"{_LA}:chunked_kda", backends=("gpu",),
                    per_shard="linear_recurrence")
  registry.register("sparse_attention.topk_indices", "pallas", f"{_SA}:topk_indices",
                    backends=("gpu",), per_shard="indexer")
  registry.register("sparse_attention.attend", "pallas", f"{_SA}:sparse_attention",
                    backends=("gpu",), per_shard="sparse_attention")
  # Dense fused attention under the selection mask where the selection is dense enough
  # (training lengths), the Pallas gather kernels past that (pallas_kernels/sparse_attention/
  # by_density.py); the masked dense form alone is picked by name.
  registry.register("sparse_attention.attend", "by_density",
                    f"{_SA}.by_density:sparse_attention_by_density", backends=("gpu",), priority=1,
                    per_shard="sparse_attention")
  registry.register("sparse_attention.attend", "masked_dense",
                    f"{_SA}.masked_dense:masked_dense_attention", backends=("cpu", "gpu", "tpu"),
                    priority=-2, per_shard="sparse_attention")
  # cuDNN's flash attention (bf16/fp16; other inputs run the reference); packed documents
  # as a [B, 1, T, T] mask.
  registry.register("attention.causal", "cudnn", f"{_CA}:cudnn_causal_attention", backends=("gpu",),
                    per_shard="rows")
  registry.register("grouped_matmul", "mosaic", f"{_GMM}:grouped_matmul", backends=("gpu",))
  registry.register("grouped_lora", "mosaic", f"{_GMM}:grouped_lora", backends=("gpu",))
  # Exact, G times the FLOPs, a GPU kernel's memory: what a CPU compile that stands in for
  # a GPU step (the dry run, docs/dry_run.md) uses in place of "mosaic" (STAND_INS). Only
  # ever picked by name.
  registry.register("grouped_matmul", "loop", f"{_GMM}.loop_over_groups:loop_grouped_matmul",
                    backends=("cpu", "gpu", "tpu"), priority=-2)
  registry.register("grouped_lora", "loop", f"{_GMM}.loop_over_groups:loop_grouped_lora",
                    backends=("cpu", "gpu", "tpu"), priority=-2)
  # Packed frozen weights (FP8 block-scaled, MXFP4, INT4) dequantized tile by tile on the
  # way into the matrix units; the loop over groups is their CPU stand-in (one group's
  # weight dequantized at a time).
  registry.register("quantized_matmul", "pallas", f"{_QMM}:quantized_matmul", backends=("gpu",),
                    per_shard="tokens")
  registry.register("quantized_grouped_matmul", "pallas", f"{_QMM}:quantized_grouped_matmul",
                    backends=("gpu",))
  registry.register("quantized_matmul", "loop", f"{_QMM}:loop_quantized_matmul",
                    backends=("cpu", "gpu", "tpu"), priority=-2)
  registry.register("quantized_grouped_matmul", "loop", f"{_QMM}:loop_quantized_grouped_matmul",
                    backends=("cpu", "gpu", "tpu"), priority=-2)
  # The references run per device as the kernels do (the same per_shard mode): what a CPU
  # compile of a GPU step runs in their place (STAND_INS), so that on a sequence split over
  # devices each holds one device's share, not the XLA-partitioned whole sequence
  # (meshes.split_recurrence, meshes.gathered_keys).
  for op, mode in _PER_DEVICE_REFERENCES.items():
    registry.register(op, PER_DEVICE_REFERENCE,
                      registry.entry(op).reference.target, backends=("cpu", "gpu", "tpu"),
                      priority=-2, per_shard=mode)
  registry.register("cross_entropy", "chunked", f"{_CE}:chunked_cross_entropy",
                    backends=("cpu", "gpu", "tpu"))
  # Named only until timed on the H200 (`python -m experiments.check_ops --ops residual_mix`).
  registry.register("residual_mix", "pallas", f"{_RM}:residual_mix", backends=("gpu",), priority=-2)
  # The KDA layer's prologue (q, k: with the L2 norm), one pass forward and two backward:
  # 1.09x the XLA path forward+backward, 1.54x forward (docs/performance.md, "The KDA
  # prologue in one pass"); on a split sequence each device's range takes the previous
  # range's last tokens (meshes.split_conv).
  registry.register("short_conv", "pallas", f"{_SC}:short_conv_silu", backends=("gpu",),
                    per_shard="causal_conv")
  return registry


# (op, an implementation) -> the implementation that stands in for it when a step planned
# for its platform is compiled where it does not run: one allocating the same memory
# (hylora.plan.run_plan; docs/dry_run.md).
STAND_INS = {
    ("grouped_matmul", "mosaic"): "loop",
    ("grouped_lora", "mosaic"): "loop",
    ("quantized_matmul", "pallas"): "loop",
    ("quantized_grouped_matmul", "pallas"): "loop",
    ("linear_attention.gla", "pallas"): PER_DEVICE_REFERENCE,
    ("linear_attention.kda", "pallas"): PER_DEVICE_REFERENCE,
    ("sparse_attention.topk_indices", "pallas"): PER_DEVICE_REFERENCE,
    ("sparse_attention.attend", "pallas"): PER_DEVICE_REFERENCE,
    ("sparse_attention.attend", "by_density"): PER_DEVICE_REFERENCE,
    ("attention.causal", "cudnn"): PER_DEVICE_REFERENCE,
    ("short_conv", "pallas"): REFERENCE,
}

# Which KernelConfig field chooses the implementation of each op.
KERNEL_CHOICE_FIELDS = {
    "linear_attention.gla": "linear_attention",
    "linear_attention.kda": "linear_attention",
    "sparse_attention.topk_indices": "topk_indices",
    "sparse_attention.attend": "sparse_attention",
    "grouped_matmul": "grouped_matmul",
    "grouped_lora": "grouped_matmul",
    "cross_entropy": "cross_entropy",
    "residual_mix": "residual_mix",
    "short_conv": "short_conv",
    "attention.causal": "causal_attention",
    "quantized_matmul": "quantized_matmul",
    "quantized_grouped_matmul": "quantized_matmul",
}


def resolve(op: str, kernels: KernelConfig | None = None, backend: str | None = None):
  """The implementation of `op` that `kernels` asks for (default: auto)."""
  field = KERNEL_CHOICE_FIELDS.get(op)
  choice = getattr(kernels, field) if (kernels is not None and field) else AUTO
  return catalog().resolve(op, choice, backend)

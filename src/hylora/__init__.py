"""hylora: LoRA fine-tuning of trillion-parameter hybrid-attention MoE models on JAX."""

import flax

# Parameters carry logical axis names as metadata; shardings are applied by the train
# step from `meshes.rules`, not eagerly at variable creation.
flax.config.update("flax_always_shard_variable", False)

__version__ = "0.1.0"

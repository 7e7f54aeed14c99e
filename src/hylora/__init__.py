"""hylora: LoRA fine-tuning of trillion-parameter hybrid-attention MoE models on JAX."""

__version__ = "0.1.0"

"""The hybrid-attention MoE model (Flax NNX) with LoRA adapters."""

from hylora.model.context import ForwardContext
from hylora.model.execution import Execution
from hylora.model.lora import LoRAParam
from hylora.model.transformer import IGNORE_INDEX, HybridLM

__all__ = ["Execution", "ForwardContext", "HybridLM", "IGNORE_INDEX", "LoRAParam"]

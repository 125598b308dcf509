"""Small, deterministic training workloads: a dense Llama decoder and its mixture-of-experts twin."""
from .llama import Llama, LlamaConfig
from .moe import MoE, MoEConfig

__all__ = ["LlamaConfig", "Llama", "MoEConfig", "MoE"]

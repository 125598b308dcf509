"""Small, deterministic training workloads with dynamic data, and the registry the harness uses.

* ``llama-varlen``: Llama decoder, sequence length drawn per step (``lm.py``)
* ``moe``: top-k routed mixture-of-experts decoder, variable length (``lm.py``)
* ``layerdrop``: stochastic depth, a random subset of blocks per step (``lm.py``)
* ``mixed``: gradient-accumulation micro-batches and evaluation steps (``lm.py``)
* ``video-dit``: Open-Sora-Plan-style video diffusion transformer over image/video buckets (``dit.py``)
* ``hf:<model_type>``: a Hugging Face causal LM from a small config (``hf.py``; needs transformers)

``get_workload(name, size, **overrides)`` makes one; sizes are "tiny" (tests), "small" (the CPU
demo) and "gpu" (an H100).

May import: torch and, in ``hf.py`` only, transformers; nothing of the engine.
Imported by: ``bench/`` and ``sim/``.
"""
from importlib.util import find_spec

from .base import Batch, Workload
from .common import SIZES
from .dit import VideoDiT, VideoDiTConfig, VideoDiTWorkload
from .lm import (LayerDrop, LayerDropConfig, LlamaVarlen, LMWorkloadConfig, Mixed, MixedConfig,
                 MoEWorkload, MoEWorkloadConfig)
from .llama import Llama, LlamaConfig
from .moe import MoE, MoEConfig

WORKLOADS = {cls.name: cls for cls in (LlamaVarlen, MoEWorkload, LayerDrop, VideoDiTWorkload, Mixed)}
HF_PREFIX = "hf:"
HF_EXAMPLES = ("hf:llama", "hf:gpt2", "hf:qwen2")  # the model types the tests cover


def workload_names() -> list[str]:
    """Every runnable workload name: the built-in ones, then the tested ``hf:`` examples when
    transformers is installed (any other ``hf:<model_type>`` with a causal LM works too)."""
    return list(WORKLOADS) + (list(HF_EXAMPLES) if find_spec("transformers") else [])


def get_workload(name: str, size: str = "small", **overrides) -> Workload:
    """The workload ``name`` at preset ``size`` ("tiny", "small" or "gpu"), with config fields
    replaced by ``overrides`` (e.g. ``get_workload("moe", "tiny", top_k=1)``)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a workload name (str); got {type(name).__name__} {name!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}; got {size!r}")
    if name.startswith(HF_PREFIX) and len(name) > len(HF_PREFIX):
        from .hf import HFCausalLM  # imports transformers, with a clear error when it is missing
        if "model_type" in overrides:
            raise ValueError(f"model_type comes from the name ({name!r}); do not override it")
        return HFCausalLM.from_preset(size, model_type=name[len(HF_PREFIX):], **overrides)
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}, "
                         f"hf:<model_type> (e.g. {', '.join(HF_EXAMPLES)})")
    return WORKLOADS[name].from_preset(size, **overrides)


__all__ = ["LlamaConfig", "Llama", "MoEConfig", "MoE", "Batch", "Workload", "WORKLOADS",
           "SIZES", "workload_names", "get_workload", "LMWorkloadConfig", "LlamaVarlen",
           "MoEWorkloadConfig", "MoEWorkload", "LayerDropConfig", "LayerDrop", "MixedConfig",
           "Mixed", "VideoDiTConfig", "VideoDiT", "VideoDiTWorkload"]

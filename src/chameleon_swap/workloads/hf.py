"""``hf:<model_type>``: any Hugging Face transformers causal LM, built from a small config.

Nothing is downloaded: ``AutoConfig.for_model(model_type, ...)`` with the sizes of the preset and
``AutoModelForCausalLM.from_config``. transformers is optional (the ``bench`` extra) and imported
only when such a workload is made, never by ``import chameleon_swap.workloads``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .base import Batch
from .common import (PresetWorkload, check_int, check_lengths, data_generator, draw_length)

# The config fields set from our sizes, when the model's config has them (GPT-2-style configs map
# these names to their own, n_embd, n_layer, ..., through attribute_map).
SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "vocab_size")


def import_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("the hf:<model_type> workloads need the transformers package, which "
                          "comes with the bench extra: pip install 'chameleon-swap[bench]'") from e
    return transformers


def causal_lm_types() -> list[str]:
    import_transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@dataclass
class HFConfig:
    model_type: str = "llama"
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 256
    batch_size: int = 2
    seq_len: int = 32            # also max_position_embeddings
    lengths: str = "bucketed"    # as in the decoder workloads: "bucketed", "uniform" or "fixed"
    buckets: tuple = (0.25, 0.5, 0.75, 1.0)

    def __post_init__(self) -> None:
        if not isinstance(self.model_type, str) or not self.model_type:
            raise TypeError(f"model_type must be a transformers model type such as 'llama'; "
                            f"got {self.model_type!r}")
        for name in SIZE_FIELDS + ("batch_size",):
            check_int(name, getattr(self, name))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"num_attention_heads must divide hidden_size ({self.hidden_size}); "
                             f"got {self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads must divide num_attention_heads "
                             f"({self.num_attention_heads}); got {self.num_key_value_heads}")
        check_lengths(self)


def hf_config(cfg: HFConfig):
    """The transformers config: our sizes where the model's config has the field, head_dim where
    the config keeps its own default instead of deriving it, no dropout (recompute must reproduce
    the forward bit for bit), no KV cache, special token ids inside the small vocabulary."""
    import_transformers()
    from transformers import AutoConfig
    default = AutoConfig.for_model(cfg.model_type)
    kw = {name: getattr(cfg, name) for name in SIZE_FIELDS if hasattr(default, name)}
    if hasattr(default, "max_position_embeddings"):
        kw["max_position_embeddings"] = cfg.seq_len
    derived = isinstance(getattr(type(default), "head_dim", None), property)
    if getattr(default, "head_dim", None) is not None and not derived:
        kw["head_dim"] = cfg.hidden_size // cfg.num_attention_heads
    for name, value in default.to_dict().items():
        if "drop" in name and isinstance(value, float):
            kw[name] = 0.0
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(default, name, None)
        if value is not None and not (isinstance(value, int) and value < cfg.vocab_size):
            kw[name] = None
    kw["use_cache"] = False
    return AutoConfig.for_model(cfg.model_type, **kw)


def find_block_list(model: nn.Module) -> nn.ModuleList:
    """The decoder's list of layers, found generically: of the ModuleLists whose members all have
    one type, the one holding the most parameters (the layers hold nearly all of them; a longer
    list of experts inside each layer holds fewer), then the longest."""
    best, best_key = None, None
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1:
            key = (sum(p.numel() for p in m.parameters()), len(m))
            if best_key is None or key > best_key:
                best, best_key = m, key
    if best is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of identical blocks")
    return best


class HFCausalLM(PresetWorkload):
    name = "hf"
    description = "a Hugging Face transformers causal LM built from a small config, variable length"
    config_class = HFConfig
    presets = {
        "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                     batch_size=2, seq_len=32),
        "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=688, vocab_size=2048,
                      batch_size=2, seq_len=256),
        "gpu": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                    num_key_value_heads=8, intermediate_size=5632, vocab_size=32000,
                    batch_size=2, seq_len=4096),  # transformers upcasts more: half the batch
    }

    def __init__(self, config: HFConfig | None = None):
        super().__init__(config)
        types = causal_lm_types()  # fails here, clearly, when transformers is missing
        if self.config.model_type not in types:
            raise ValueError(f"model_type {self.config.model_type!r} has no causal LM in "
                             f"transformers; some that do: {', '.join(types[:40])}, ...")
        self.name = f"hf:{self.config.model_type}"
        self.description = f"transformers {self.config.model_type} causal LM, variable length"

    def build(self, device, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
        from transformers import AutoModelForCausalLM
        cfg, device = hf_config(self.config), torch.device(device)
        if device.type == "meta":
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(cfg).to(dtype)
        # transformers initialises from the global RNG: seed it inside a fork, so the caller's
        # RNG state is untouched and one seed gives one set of weights.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(cfg)
        return model.to(device=device, dtype=dtype)

    def batches(self, steps: int, device, seed: int = 0) -> list[Batch]:
        check_int("steps", steps, minimum=0)
        cfg, gen = self.config, data_generator(seed)
        out = []
        for _ in range(steps):
            T = draw_length(cfg, gen)
            ids = torch.randint(cfg.vocab_size, (cfg.batch_size, T), generator=gen).to(device)
            # transformers shifts the labels itself: the labels are the inputs.
            out.append(Batch((ids,), {"labels": ids, "use_cache": False},
                             tokens=cfg.batch_size * T, tag=f"T={T}"))
        return out

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model(*batch.args, **batch.kwargs).loss

    def block_lists(self, model: nn.Module) -> list[nn.ModuleList]:
        return [find_block_list(model)]

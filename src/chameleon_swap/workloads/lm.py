"""Language-model workloads on the Llama decoder (``llama.py``) and its MoE twin (``moe.py``).

Each one makes the step's operator sequence change in its own way, decided up front in
``batches`` from the seed:

* ``llama-varlen``: the sequence length of every step, from buckets or uniform in a range;
* ``moe``: variable length too, and top-k routing that changes which experts run;
* ``layerdrop``: a random subset of blocks is skipped each step (LayerDrop, Fan et al. 2019);
* ``mixed``: gradient-accumulation micro-batches of varying length with an evaluation step
  (no backward, nothing saved) every few optimizer steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from .base import Batch
from .common import (PresetWorkload, build_on, check_fraction, check_int, check_lengths,
                     data_generator, draw_length, token_batch)
from .llama import Llama, LlamaConfig
from .moe import MoE, MoEConfig


@dataclass
class LMWorkloadConfig:
    """Model size and length schedule of a decoder workload.

    ``lengths``: "bucketed" draws each step's length from ``buckets`` (fractions of ``seq_len``),
    "uniform" any length from the shortest bucket to ``seq_len``, "fixed" always ``seq_len``.
    """
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: Optional[int] = None        # None: the SwiGLU default for dim
    batch_size: int = 2
    seq_len: int = 64                    # the longest sequence of the schedule
    lengths: str = "bucketed"
    buckets: tuple = (0.25, 0.5, 0.75, 1.0)

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size)
        check_lengths(self)
        self.model_config()  # the model fields are checked by the model's own config

    def model_config(self) -> LlamaConfig:
        return LlamaConfig(**self._model_fields())

    def _model_fields(self) -> dict:
        return dict(vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers,
                    n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, ffn_dim=self.ffn_dim,
                    max_seq_len=self.seq_len)


# Sizes shared by the decoder workloads. tiny: a test step in milliseconds; small: a CPU demo step
# of tens of ms with 10-50 MiB of saved activations; gpu: a 0.8B model on an H100, 16k tokens a
# step: ~45 GB of fp32 activations (166 KiB per token and layer, measured on CPU) plus the logits.
LM_TINY = dict(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, batch_size=2, seq_len=32)
LM_SMALL = dict(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, batch_size=2,
                seq_len=256)
LM_GPU = dict(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, batch_size=4,
              seq_len=4096)


class LlamaVarlen(PresetWorkload):
    name = "llama-varlen"
    description = "Llama decoder; the sequence length changes every step (buckets or uniform)"
    config_class = LMWorkloadConfig
    model_class = Llama
    presets = {"tiny": LM_TINY, "small": LM_SMALL, "gpu": LM_GPU}

    def build(self, device, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
        cfg = self.config.model_config()

        def init(model):
            model.reset_buffers()
            model.init_weights(seed)
        return build_on(device, dtype, lambda: self.model_class(cfg), init)

    def batches(self, steps: int, device, seed: int = 0) -> list[Batch]:
        check_int("steps", steps, minimum=0)
        gen = data_generator(seed)
        return [self.train_batch(gen, draw_length(self.config, gen), device) for _ in range(steps)]

    def train_batch(self, gen: torch.Generator, T: int, device, **kwargs) -> Batch:
        cfg = self.config
        x, y = token_batch(gen, cfg.vocab_size, cfg.batch_size, T, device)
        return Batch((x, y), kwargs, tokens=cfg.batch_size * T, tag=f"T={T}")

    def block_lists(self, model: nn.Module) -> list[nn.ModuleList]:
        return [model.layers]


# ------------------------------------------------------------------ moe
@dataclass
class MoEWorkloadConfig(LMWorkloadConfig):
    n_experts: int = 4
    top_k: int = 2
    expert_ffn_dim: Optional[int] = None  # None: ffn_dim

    def model_config(self) -> MoEConfig:
        return MoEConfig(**self._model_fields(), n_experts=self.n_experts, top_k=self.top_k,
                         expert_ffn_dim=self.expert_ffn_dim)


class MoEWorkload(LlamaVarlen):
    name = "moe"
    description = ("top-k routed mixture-of-experts decoder with variable length: routing, "
                   "expert calls and shapes change every step")
    config_class = MoEWorkloadConfig
    model_class = MoE
    # gpu: four experts of half the dense width (1.4B parameters) and half the batch: ~26 GB of
    # fp32 activations (200 KiB per token and layer).
    presets = {"tiny": LM_TINY, "small": LM_SMALL,
               "gpu": {**LM_GPU, "expert_ffn_dim": 2816, "batch_size": 2}}


# ------------------------------------------------------------------ layerdrop
@dataclass
class LayerDropConfig(LMWorkloadConfig):
    lengths: str = "fixed"     # only the depth changes, unless asked otherwise
    drop_prob: float = 0.25    # each block is skipped with this probability (at least one runs)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fraction("drop_prob", self.drop_prob, closed_top=False)


class LayerDrop(LlamaVarlen):
    name = "layerdrop"
    description = "Llama decoder with stochastic depth: a random subset of blocks runs each step"
    config_class = LayerDropConfig
    presets = {"tiny": {**LM_TINY, "n_layers": 4}, "small": {**LM_SMALL, "n_layers": 6},
               "gpu": LM_GPU}

    def batches(self, steps: int, device, seed: int = 0) -> list[Batch]:
        check_int("steps", steps, minimum=0)
        gen = data_generator(seed)
        out = []
        for _ in range(steps):
            u = torch.rand(self.config.n_layers, generator=gen)
            kept = (u >= self.config.drop_prob).nonzero().flatten().tolist()  # host tensor
            keep = tuple(kept) if kept else (int(u.argmax()),)
            b = self.train_batch(gen, draw_length(self.config, gen), device, keep=keep)
            b.tag = f"keep={','.join(map(str, keep))} {b.tag}"
            out.append(b)
        return out


# ------------------------------------------------------------------ mixed
@dataclass
class MixedConfig(LMWorkloadConfig):
    accum_steps: int = 2   # micro-batches per optimizer step
    eval_every: int = 2    # optimizer steps between evaluation steps

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("accum_steps", self.accum_steps)
        check_int("eval_every", self.eval_every)


class Mixed(LlamaVarlen):
    name = "mixed"
    description = ("Llama decoder trained with gradient-accumulation micro-batches of varying "
                   "length and an evaluation step (no_grad) every few optimizer steps")
    config_class = MixedConfig
    presets = {"tiny": LM_TINY, "small": {**LM_SMALL, "accum_steps": 4},
               "gpu": {**LM_GPU, "accum_steps": 4}}

    def batches(self, steps: int, device, seed: int = 0) -> list[Batch]:
        """Groups of ``accum_steps`` micro-batches, ``optimizer_step`` on the last of each (and on
        the last batch of the schedule), then one full-length evaluation batch after every
        ``eval_every`` groups."""
        check_int("steps", steps, minimum=0)
        cfg, gen = self.config, data_generator(seed)
        out: list[Batch] = []
        groups = 0
        while len(out) < steps:
            for micro in range(cfg.accum_steps):
                if len(out) == steps:
                    break
                b = self.train_batch(gen, draw_length(cfg, gen), device)
                b.optimizer_step = micro == cfg.accum_steps - 1 or len(out) == steps - 1
                out.append(b)
            groups += 1
            if groups % cfg.eval_every == 0 and len(out) < steps:
                b = self.train_batch(gen, cfg.seq_len, device)
                b.train, b.optimizer_step, b.tag = False, False, f"eval {b.tag}"
                out.append(b)
        return out

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        loss = model(*batch.args, **batch.kwargs)
        # As in nanoGPT: each micro-batch contributes 1/accum_steps of the gradient, so an
        # accumulated step sees the mean over its group. Evaluation losses are not scaled.
        return loss / self.config.accum_steps if batch.train else loss

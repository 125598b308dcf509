"""Decoder-only transformer configurations for the analytic generator, and named presets.

Two block layouts: ``llama`` (RMSNorm, rotary positions, SwiGLU MLP, no dropout, grouped-query
attention) and ``gpt`` (LayerNorm, GELU MLP of width ``ffn``, dropout): the latter is the layer
Korthikanti et al. 2022 count activations for, so the generator can be checked against their
formula. A mixture-of-experts model replaces each dense MLP by ``experts`` SwiGLU experts of width
``expert_ffn``, ``top_k`` chosen per token.

Preset shapes are the published ones (sources next to each); sequence length and micro-batch are
run settings, not part of a model, and are given separately.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .hardware import DTYPE_BYTES

ARCHS = ("llama", "gpt")
# Mixed-precision Adam keeps 2 (fp16/bf16 weights) + 2 (gradients) + 12 (fp32 master weights,
# momentum, variance) bytes per parameter: Rajbhandari et al. 2020 (ZeRO), Sec. 3.1.
ADAM_MIXED_BYTES_PER_PARAM = 16


@dataclass
class ModelConfig:
    layers: int
    hidden: int
    heads: int
    vocab: int
    kv_heads: Optional[int] = None      # None: as many as heads (multi-head attention)
    ffn: Optional[int] = None           # None: SwiGLU's 8/3 * hidden (llama), 4 * hidden (gpt)
    arch: str = "llama"
    seq: int = 4096
    micro_batch: int = 1
    dtype: str = "bf16"
    flash: bool = True                  # FlashAttention (Dao et al. 2022): no s^2 tensors saved
    experts: int = 0                    # 0: dense MLP
    top_k: int = 0                      # None of it when dense; default 2 with experts
    expert_ffn: Optional[int] = None    # None: ffn
    dropout: Optional[float] = None     # None: 0 for llama, 0.1 for gpt
    tied_embeddings: bool = False
    state_bytes_per_param: int = ADAM_MIXED_BYTES_PER_PARAM
    tp: int = 1                         # tensor-parallel degree (with sequence parallelism)
    dp_shard: int = 1                   # ranks the optimizer states are sharded over (ZeRO-1)
    name: str = "custom"

    def __post_init__(self) -> None:
        for k in ("layers", "hidden", "heads", "vocab", "seq", "micro_batch", "tp", "dp_shard",
                  "state_bytes_per_param"):
            _pos_int(k, getattr(self, k))
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}; got {self.arch!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}; got {self.dtype!r}")
        if self.kv_heads is None:
            self.kv_heads = self.heads
        _pos_int("kv_heads", self.kv_heads)
        if self.hidden % self.heads:
            raise ValueError(f"heads must divide hidden ({self.hidden}); got heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads must divide heads ({self.heads}); got {self.kv_heads}")
        if self.ffn is None:
            self.ffn = 4 * self.hidden if self.arch == "gpt" else _swiglu(self.hidden)
        _pos_int("ffn", self.ffn)
        if not isinstance(self.experts, int) or isinstance(self.experts, bool) or self.experts < 0:
            raise ValueError(f"experts must be an int >= 0 (0: dense MLP); got {self.experts!r}")
        if self.experts:
            if self.arch != "llama":
                raise ValueError("experts (MoE) needs arch='llama' (SwiGLU experts)")
            if self.top_k == 0:
                self.top_k = 2
            if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.experts:
                raise ValueError(f"top_k must be an int from 1 to experts ({self.experts}); "
                                 f"got {self.top_k!r}")
            if self.expert_ffn is None:
                self.expert_ffn = self.ffn
            _pos_int("expert_ffn", self.expert_ffn)
        elif self.top_k:
            raise ValueError(f"top_k needs experts > 0; got top_k={self.top_k}, experts=0")
        if self.dropout is None:
            self.dropout = 0.1 if self.arch == "gpt" else 0.0
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be a number in [0, 1); got {self.dropout!r}")
        if not isinstance(self.flash, bool):
            raise ValueError(f"flash must be True or False; got {self.flash!r}")
        for k in ("heads", "kv_heads"):
            if getattr(self, k) % self.tp:
                raise ValueError(f"tp must divide {k} ({getattr(self, k)}); got tp={self.tp}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_hidden(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def elem(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch

    def params(self) -> int:
        """Parameter count: embeddings, attention, MLP or experts and router, norms, head."""
        h, L = self.hidden, self.layers
        attn = h * (h + 2 * self.kv_hidden) + h * h
        if self.experts:
            mlp = self.experts * 3 * h * self.expert_ffn + h * self.experts
        elif self.arch == "gpt":
            mlp = 2 * h * self.ffn
        else:
            mlp = 3 * h * self.ffn
        norms = 2 * h * (2 if self.arch == "gpt" else 1)       # LayerNorm also has a bias
        biases = (3 * h + 2 * self.kv_hidden + self.ffn) if self.arch == "gpt" else 0
        head = 0 if self.tied_embeddings else self.vocab * h
        final = h * (2 if self.arch == "gpt" else 1)
        pos = self.seq * h if self.arch == "gpt" else 0          # learned positions (GPT)
        return self.vocab * h + pos + L * (attn + mlp + norms + biases) + final + head

    def model_state_bytes(self) -> int:
        """Per device: weights and gradients split over ``tp``; the optimizer's 12 bytes per
        parameter (of the 16) also over ``dp_shard`` (ZeRO stage 1)."""
        n = self.params() / self.tp
        per = self.state_bytes_per_param
        opt = max(0, per - 4)
        return int(n * (per - opt) + n * opt / self.dp_shard)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def describe(self) -> str:
        moe = f", {self.experts} experts top-{self.top_k}" if self.experts else ""
        return (f"{self.name}: {self.params() / 1e9:.2f}B params, {self.layers} layers, hidden "
                f"{self.hidden}, {self.heads} heads ({self.kv_heads} kv), ffn {self.ffn}{moe}, "
                f"vocab {self.vocab}; seq {self.seq} x micro-batch {self.micro_batch}, "
                f"{self.dtype}, flash {'on' if self.flash else 'off'}, tp {self.tp}"
                + (f", ZeRO-1 over {self.dp_shard}" if self.dp_shard > 1 else ""))


def _swiglu(h: int) -> int:
    # 8/3 * hidden (the parameter count of a 4 * hidden GELU MLP), rounded up to 256.
    return 256 * math.ceil(8 * h / 3 / 256)


def _pos_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name} must be a positive int; got {v!r}")


# Published shapes. Llama 2: Touvron et al. 2023, "Llama 2: Open Foundation and Fine-Tuned Chat
# Models" (and the released configs for the MLP widths); LLaMA 33B: Touvron et al. 2023, "LLaMA",
# Table 2; Llama 3 / 3.2: Meta's model cards and released configs; Mixtral: Jiang et al. 2024,
# "Mixtral of Experts", Table 1; GPT-3: Brown et al. 2020, Table 2.1.
PRESETS: dict[str, dict] = {
    "llama3.2-1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256,
                        tied_embeddings=True),
    "llama3.2-3b": dict(layers=28, hidden=3072, heads=24, kv_heads=8, ffn=8192, vocab=128256,
                        tied_embeddings=True),
    "llama-7b": dict(layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000),
    "llama3-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    "llama-13b": dict(layers=40, hidden=5120, heads=40, ffn=13824, vocab=32000),
    "llama-33b": dict(layers=60, hidden=6656, heads=52, ffn=17920, vocab=32000),
    "mixtral-8x7b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000,
                         experts=8, top_k=2),
    "llama-70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000),
    "llama3-70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256),
    "gpt3-175b": dict(arch="gpt", layers=96, hidden=12288, heads=96, vocab=50257, seq=2048),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A preset by name with run settings (``seq``, ``micro_batch``, ``dtype``, ``flash``, ``tp``)
    overridden; unknown names list the valid ones."""
    if name not in PRESETS:
        raise ValueError(f"model must be one of {', '.join(PRESETS)}; got {name!r}")
    kw = dict(PRESETS[name])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return ModelConfig(name=name, **kw)



def read_json(spec: str, arg: str):
    """The JSON in file ``spec``; errors name the argument ``arg`` it was given as."""
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"{arg}: no such file {spec!r}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{arg}: {spec} is not valid JSON ({exc})") from exc


def resolve(name_or_path: str, **overrides) -> ModelConfig:
    """A preset by name, or a JSON file of ``ModelConfig`` fields (any shape: layers, hidden,
    heads, kv_heads, ffn, vocab, experts, top_k, ...), with ``overrides`` applied."""
    if name_or_path in PRESETS:
        return preset(name_or_path, **overrides)
    path = Path(name_or_path)
    if not (name_or_path.endswith(".json") or path.is_file()):
        raise ValueError(f"model must be one of {', '.join(PRESETS)}, or a JSON file of "
                         f"ModelConfig fields; got {name_or_path!r}")
    fields = read_json(name_or_path, "model")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    if not isinstance(fields, dict) or set(fields) - known:
        bad = sorted(set(fields) - known) if isinstance(fields, dict) else fields
        raise ValueError(f"model: {name_or_path} must hold an object of ModelConfig fields "
                         f"({', '.join(sorted(known))}); unknown: {bad}")
    fields.setdefault("name", path.stem)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return ModelConfig(**fields)
    except TypeError as exc:
        raise ValueError(f"model: {name_or_path}: {exc}") from exc


def family() -> list[str]:
    """Dense presets from smallest to largest (the model-size axis of ``capacity``)."""
    dense = [n for n, kw in PRESETS.items() if not kw.get("experts")]
    return sorted(dense, key=lambda n: ModelConfig(**PRESETS[n]).params())

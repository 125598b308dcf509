"""What the workloads share: size presets, config checks, seeded generators, length schedules.

A workload is made from one config dataclass; ``presets`` holds the field values of each size, so
``get_workload("moe", "small", top_k=1)`` is ``MoEWorkload(MoEWorkloadConfig(**small, top_k=1))``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Optional, Sequence

import torch
import torch.nn as nn

from .base import Workload

SIZES = ("tiny", "small", "gpu")


class PresetWorkload(Workload):
    """A workload configured by one dataclass (``config_class``), with a preset per size."""

    config_class: ClassVar[type]
    presets: ClassVar[dict[str, dict[str, Any]]]

    def __init__(self, config: Optional[Any] = None):
        config = self.config_class() if config is None else config
        if not isinstance(config, self.config_class):
            raise TypeError(f"config must be a {self.config_class.__name__}; "
                            f"got {type(config).__name__}")
        self.config = config

    @classmethod
    def from_preset(cls, size: str = "small", **overrides) -> "PresetWorkload":
        if size not in cls.presets:
            raise ValueError(f"size must be one of {', '.join(cls.presets)}; got {size!r}")
        fields = [f.name for f in dataclasses.fields(cls.config_class) if f.init]
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise ValueError(f"unknown override(s) {', '.join(unknown)} for workload {cls.name!r}; "
                             f"accepted: {', '.join(fields)}")
        return cls(cls.config_class(**{**cls.presets[size], **overrides}))


def data_generator(seed: int) -> torch.Generator:
    """The generator of a schedule: offset from the weights' seed, so that data drawn with the same
    ``seed`` as the weights does not repeat their random numbers."""
    return torch.Generator().manual_seed(1_000_003 + seed)


def draw_int(gen: torch.Generator, low: int, high: int) -> int:
    """A uniform int in [low, high), from ``gen`` on the host (no device involved)."""
    return int(torch.randint(low, high, (), generator=gen))


# ------------------------------------------------------------------ checks for __post_init__
def check_int(name: str, value, minimum: int = 1) -> None:
    # bool is an int subclass: batch_size=True is surely a mistake, not a batch of one.
    accepted = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {accepted}; got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be {accepted}; got {value!r}")


def check_choice(name: str, value, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def check_fraction(name: str, value, *, closed_top: bool) -> None:
    """A number in [0, 1) (``closed_top=False``) or (0, 1] (``closed_top=True``)."""
    accepted = "a number in (0, 1]" if closed_top else "a number in [0, 1)"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {accepted}; got {type(value).__name__} {value!r}")
    ok = (0 < value <= 1) if closed_top else (0 <= value < 1)
    if not (math.isfinite(value) and ok):
        raise ValueError(f"{name} must be {accepted}; got {value!r}")


def as_tuple(name: str, value, accepted: str) -> tuple:
    """Lists become tuples (configs stay hashable and printable); anything else is refused."""
    if isinstance(value, (list, tuple)) and len(value) > 0:
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    raise TypeError(f"{name} must be {accepted}; got {value!r}")


# ------------------------------------------------------------------ sequence lengths
LENGTH_MODES = ("bucketed", "uniform", "fixed")


def check_lengths(cfg) -> None:
    """Validate ``seq_len``, ``lengths`` and ``buckets`` of a config with a length schedule."""
    check_int("seq_len", cfg.seq_len)
    check_choice("lengths", cfg.lengths, LENGTH_MODES)
    cfg.buckets = as_tuple("buckets", cfg.buckets,
                           "a non-empty tuple of fractions of seq_len in (0, 1]")
    for b in cfg.buckets:
        check_fraction("buckets", b, closed_top=True)


def length_choices(cfg) -> list[int]:
    """The lengths a bucketed schedule draws from: each bucket's fraction of seq_len, at least 1."""
    return sorted({max(1, round(cfg.seq_len * b)) for b in cfg.buckets})


def draw_length(cfg, gen: torch.Generator) -> int:
    """One step's sequence length: "bucketed" picks one of ``length_choices``, "uniform" any length
    from the shortest bucket to ``seq_len``, "fixed" always ``seq_len``."""
    if cfg.lengths == "fixed":
        return cfg.seq_len
    choices = length_choices(cfg)
    if cfg.lengths == "bucketed":
        return choices[draw_int(gen, 0, len(choices))]
    return draw_int(gen, choices[0], cfg.seq_len + 1)


def token_batch(gen: torch.Generator, vocab_size: int, batch_size: int, T: int,
                device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of shape (batch_size, T): a random token stream shifted by one."""
    tokens = torch.randint(vocab_size, (batch_size, T + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


# ------------------------------------------------------------------ building
def build_on(device, dtype: torch.dtype, make, init) -> nn.Module:
    """``make()`` on the meta device (no memory, no draw from the global RNG), cast to ``dtype``,
    then storage on ``device`` and ``init(model)`` to fill it. On the meta device itself there is
    nothing to fill: that is how a gpu-size model is checked on a laptop."""
    device = torch.device(device)
    with torch.device("meta"):
        model = make().to(dtype)
    if device.type == "meta":
        return model
    model = model.to_empty(device=device)
    init(model)
    return model

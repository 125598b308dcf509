"""What a benchmark workload is: a model, a seeded schedule of batches, and how to get a loss.

The harness (``chameleon_swap.bench``), the demo and the simulator's calibration all drive models
through this one small interface, so a workload never knows which baseline or engine runs it
(gpt-fast's rule: features are applied from outside the model).

* ``build(device, dtype, seed)`` returns a fresh model; the same seed gives bit-identical weights,
  so every baseline starts from the same state.
* ``batches(steps, device, seed)`` returns the whole schedule up front: what changes from step to
  step (sequence length, routing inputs, dropped layers, image/video bucket, eval steps) is decided
  here on the host, from the seed alone, so every baseline sees exactly the same steps.
* ``loss(model, batch)`` runs the forward pass and returns a scalar loss; ``run(model, batch)``
  is one whole step of it (backward too when the batch trains).
* ``block_lists(model)`` names the ``nn.ModuleList`` s of repeated blocks, which recompute baselines
  wrap with activation checkpointing.

A ``Batch`` is one ``eng.step()``: one forward and, when ``train``, one backward.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn


@dataclass
class Batch:
    args: tuple                                    # positional inputs after the model
    kwargs: dict = field(default_factory=dict)     # keyword inputs (e.g. which layers run)
    train: bool = True                             # False: an evaluation step under no_grad
    tokens: int = 0                                # tokens (or patches) processed, for tokens/s
    tag: str = ""                                  # what shapes this step: "T=256", "video 8x16x16"
    optimizer_step: bool = True                    # False inside gradient accumulation


class Workload(ABC):
    """Base class; subclasses set ``name`` and ``description`` and implement the abstract methods."""

    name: str = ""
    description: str = ""

    @abstractmethod
    def build(self, device: torch.device, dtype: torch.dtype = torch.float32,
              seed: int = 0) -> nn.Module:
        ...

    @abstractmethod
    def batches(self, steps: int, device: torch.device, seed: int = 0) -> list[Batch]:
        ...

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model(*batch.args, **batch.kwargs)

    def run(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """One step of ``batch``: forward and backward when it trains, forward under no_grad when
        it evaluates. Returns the detached loss. (The optimizer is the caller's.)"""
        if batch.train:
            loss = self.loss(model, batch)
            loss.backward()
        else:
            with torch.no_grad():
                loss = self.loss(model, batch)
        return loss.detach()

    @abstractmethod
    def block_lists(self, model: nn.Module) -> list[nn.ModuleList]:
        ...

    def config_dict(self) -> dict[str, Any]:
        """The workload's size and schedule settings, for result files."""
        cfg: Optional[Any] = getattr(self, "config", None)
        if cfg is None:
            return {}
        import dataclasses
        return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(vars(cfg))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

"""The ways to fit a step's activations that the harness compares, behind one small interface.

A baseline prepares a freshly built model (wrapping blocks, for recomputation), gives the context
one training step runs in, and reports what it did after each step. It never changes the model's
arithmetic: every baseline's losses are compared bit for bit with ``none``.

==================  =============================================================================
``none``            nothing: every activation stays on the device
``full-recompute``  non-reentrant ``torch.utils.checkpoint`` around every block
``selective-recompute``  PyTorch's selective activation checkpointing per block: outputs of
                    matmuls and attention are saved, everything else is recomputed
``save-on-cpu``     ``torch.autograd.graph.save_on_cpu`` (pinned on CUDA): synchronous, everything
``swap-all``        every activation out asynchronously after its save, back at unpack: torchtune's
                    ``OffloadActivations`` where it runs (CUDA, torchtune installed), else our
                    equivalent (``bench/swap_all.py``), labelled ``swap-all (ours)``
``static``, ``guard``, ``chameleon``  the engine under that policy, at the budget (swap only)
``hybrid``          the engine's default policy given the workload's model and its blocks
                    (``Chameleon(budget, model=..., blocks=...)``): each block kept, selectively
                    or fully recomputed, together with the swaps, at the budget
==================  =============================================================================

The engine's baselines (``ENGINE_BASELINES``) are the ones that take a budget.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..engine import Chameleon
from ..workloads.base import Workload
from .swap_all import SwapAll

ENGINE_POLICIES = ("static", "guard", "chameleon")
HYBRID = "hybrid"
ENGINE_BASELINES = ENGINE_POLICIES + (HYBRID,)     # the baselines that run at a budget
PEERS = ("none", "full-recompute", "selective-recompute", "save-on-cpu", "swap-all")
BASELINES = PEERS + ENGINE_BASELINES
# StepStats fields an engine baseline reports per step where the engine has them (some are newer
# than others; a missing one is left out, never invented).
_OPTIONAL_STATS = ("block_modes", "recomputed_bytes", "recompute_seconds",
                   "predicted_stall_seconds", "predicted_step_seconds")


class Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward (non-reentrant checkpoint)."""

    def __init__(self, block: nn.Module, context_fn=None) -> None:
        super().__init__()
        self.block = block
        self.context_fn = context_fn

    def forward(self, *args, **kwargs):
        if self.context_fn is None:
            return checkpoint(self.block, *args, use_reentrant=False, **kwargs)
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=self.context_fn,
                          **kwargs)


def _saved_ops() -> set:
    """Ops whose outputs selective recompute keeps: the expensive ones (matmuls, attention), as
    PyTorch's selective activation checkpointing examples and torchtitan's "op" policy do."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu"]
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    keep = _saved_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


class Baseline:
    """``prepare(model, workload)`` once; ``with b.step(): ...`` per step; ``stats()`` after."""

    name = "none"
    label = "none"
    engine: Optional[Chameleon] = None

    def __init__(self, device: torch.device, budget: Optional[int]) -> None:
        self.device = device
        self.budget = budget

    def prepare(self, model: nn.Module, workload: Workload) -> nn.Module:
        return model

    def step(self):
        return contextlib.nullcontext()

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class Recompute(Baseline):
    name = label = "full-recompute"
    selective = False

    def prepare(self, model: nn.Module, workload: Workload) -> nn.Module:
        context = _selective_context if self.selective else None
        for blocks in workload.block_lists(model):
            for i, block in enumerate(blocks):
                if not isinstance(block, Checkpointed):
                    blocks[i] = Checkpointed(block, context)
        return model


class SelectiveRecompute(Recompute):
    name = label = "selective-recompute"
    selective = True


class SaveOnCpu(Baseline):
    name = label = "save-on-cpu"

    def step(self):
        # Pinning needs a CUDA device; on the CPU a CPU tensor's copy "to the CPU" is itself.
        return torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")


class SwapEverything(Baseline):
    name = "swap-all"

    def __init__(self, device: torch.device, budget: Optional[int],
                 host_limit_bytes: int = 64 * 2**30) -> None:
        super().__init__(device, budget)
        self._torchtune = None
        if device.type == "cuda":
            try:
                from torchtune.training import OffloadActivations
                self._torchtune = OffloadActivations
            except Exception:            # not installed, or its own imports fail
                self._torchtune = None
        self._ours = None if self._torchtune else SwapAll(device, host_limit_bytes)
        self.label = "swap-all (torchtune)" if self._torchtune else "swap-all (ours)"

    def step(self):
        return self._torchtune() if self._torchtune else self._ours.step()

    def stats(self) -> dict:
        if self._ours is None:
            return {}
        return {"moved_bytes": self._ours.moved_bytes, "fetched_bytes": self._ours.fetched_bytes}

    def close(self) -> None:
        if self._ours is not None:
            self._ours.close()


class EngineBaseline(Baseline):
    def __init__(self, device: torch.device, budget: Optional[int], policy: str,
                 **engine_kwargs) -> None:
        super().__init__(device, budget)
        self.name = self.label = policy
        self.engine = Chameleon(budget, device=device, policy=policy, **engine_kwargs)

    def step(self):
        return self.engine.step()

    def stats(self) -> dict:
        s = self.engine.last_step
        out = {"activation_peak_bytes": s.peak_resident_bytes, "saved_bytes": s.saved_bytes,
               "moved_bytes": s.offloaded_bytes,
               "fetched_bytes": s.prefetched_bytes + s.fetched_bytes,
               "stall_seconds": s.stall_seconds, "sync_fetches": s.sync_fetches,
               "sequence_changed": s.sequence_changed, "plan_source": s.plan_source,
               "profiler_seconds": s.profiler_seconds}
        for k in _OPTIONAL_STATS:
            if hasattr(s, k):
                v = getattr(s, k)
                out[k] = list(v) if isinstance(v, tuple) else v
        return out

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


class HybridBaseline(EngineBaseline):
    """The engine with ``model=``: its default policy keeps, swaps or recomputes each of the
    workload's blocks (``workload.block_lists``), whichever its plan predicts fastest under the
    budget. The engine needs the model, so it is made in ``prepare``: a fresh one for each freshly
    built model (the timed and the metered pass each build their own), the previous one closed."""

    def __init__(self, device: torch.device, budget: Optional[int], **engine_kwargs) -> None:
        Baseline.__init__(self, device, budget)
        self.name = self.label = HYBRID
        self.engine = None
        self._engine_kwargs = engine_kwargs

    def prepare(self, model: nn.Module, workload: Workload) -> nn.Module:
        blocks = [b for blocks in workload.block_lists(model) for b in blocks]
        if self.engine is not None:
            self.engine.close()
        self.engine = Chameleon(self.budget, device=self.device, policy="chameleon", model=model,
                                blocks=blocks or None, **self._engine_kwargs)
        return model

    def step(self):
        if self.engine is None:
            raise RuntimeError("the hybrid baseline makes its engine from the model: call "
                               "prepare(model, workload) before step()")
        return self.engine.step()


_PEER_CLASSES = {"none": Baseline, "full-recompute": Recompute,
                 "selective-recompute": SelectiveRecompute, "save-on-cpu": SaveOnCpu,
                 "swap-all": SwapEverything}


def check_baselines(names) -> list[str]:
    """The names, checked; unknown ones raise ValueError listing the valid ones."""
    out = []
    for n in names:
        if n not in BASELINES:
            raise ValueError(f"unknown baseline {n!r}; choose from {', '.join(BASELINES)}")
        if n not in out:
            out.append(n)
    return out


def make_baseline(name: str, device: torch.device, budget: Optional[int],
                  **engine_kwargs) -> Baseline:
    check_baselines([name])
    if name == HYBRID:
        return HybridBaseline(device, budget, **engine_kwargs)
    if name in ENGINE_POLICIES:
        return EngineBaseline(device, budget, name, **engine_kwargs)
    return _PEER_CLASSES[name](device, budget)

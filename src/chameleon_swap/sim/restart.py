"""The planner's answer at a (re)start on ``world`` ranks: the layout, the memory mode and the
per-rank activation budget the elastic runtime applies (``examples/elastic_train.py`` asks at
every start, with the world size torchrun gives it).

After a rank is lost, torchrun restarts the survivors on a smaller world; the global batch is
kept (``chameleon_swap.elastic.GlobalBatches``), so each rank takes more samples and saves more
activations. ``plan_restart`` runs the pipeline simulator (``sim/pipeline.py``) for one rank of
the new layout, one stage running one micro-batch of the rank's samples (the most any rank
gets: ``ceil(global_batch / world)``), in each memory mode, and returns the fastest that fits:

* ``none``: everything kept;
* ``recompute``: full recomputation of every block;
* ``engine``: the engine keeps and swaps under the budget;
* ``hybrid``: the engine keeps, swaps and recomputes per block under the budget.

The budget is what device memory leaves once the rank's model states and the step's workspace
(logits, loss) are set aside, the same figure the simulator's ``engine`` mode plans with. How a
runtime applies the answer: a ``Chameleon(budget=budget_bytes)`` per rank, given the model
(``model=``, so that it may recompute blocks) when ``recompute`` is true (modes ``recompute``
and ``hybrid``); ``chameleon_swap.elastic.engine_for`` does that from ``as_dict()``. Under
``none`` the budget holds everything the simulator predicts, so the engine moves nothing unless
the real step saves more than predicted.

Layouts: data parallel over the whole world (``dp = world``). Pipeline or tensor-parallel
layouts after a failure are planned by ``recovery.plan_recovery`` (``chameleon-swap recover``);
the runtime here restarts data-parallel workers only.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from .hardware import Hardware
from .models import ModelConfig
from .pipeline import MODES, simulate_pipeline
from .recovery import Layout, RecoveryError

# Modes the engine runs with the model given (it recomputes blocks).
RECOMPUTE_MODES = ("recompute", "hybrid")


@dataclass
class RestartPlan:
    world: int
    layout: Layout
    samples_per_rank: int          # the most any rank takes of the global batch
    mode: str                      # one of MODES
    budget_bytes: int              # activations resident per rank
    recompute: bool                # the engine needs the model (recompute or hybrid)
    state_bytes: int               # model states per rank
    activation_bytes: int          # predicted activation peak per rank under ``mode``
    peak_bytes: int                # states + activations + workspace, per rank
    device_memory_bytes: int       # what the rank may use (the hardware's usable memory)
    step_seconds: float            # predicted on the hardware
    modes: dict                    # every mode: {"fits": bool, "step_seconds": float}

    def as_dict(self) -> dict:
        """Plain data for the runtime (``chameleon_swap.elastic.engine_for``) and logs."""
        return {"world": self.world, "dp": self.layout.dp, "pp": self.layout.pp,
                "tp": self.layout.tp, "samples_per_rank": self.samples_per_rank,
                "mode": self.mode, "budget_bytes": self.budget_bytes,
                "recompute": self.recompute, "state_bytes": self.state_bytes,
                "activation_bytes": self.activation_bytes, "peak_bytes": self.peak_bytes,
                "device_memory_bytes": self.device_memory_bytes,
                "step_seconds": self.step_seconds, "modes": self.modes}


def plan_restart(cfg: ModelConfig, hw: Hardware, world: int, global_batch: int,
                 device_memory_bytes: Optional[int] = None) -> RestartPlan:
    """The layout, mode and per-rank budget for ``world`` ranks sharing ``global_batch``
    samples of ``cfg`` (its ``seq``; its ``micro_batch`` is replaced by the rank's samples) on
    ``hw``; ``device_memory_bytes`` (optional) replaces the hardware's memory, nothing reserved
    (a CPU run emulating a smaller device). Raises ``RecoveryError`` when no mode fits."""
    for name, v in (("world", world), ("global_batch", global_batch)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int; got {v!r}")
    if world > global_batch:
        raise ValueError(f"world ({world}) must not exceed global_batch ({global_batch}): a "
                         f"rank would get no sample")
    if device_memory_bytes is not None:
        if (not isinstance(device_memory_bytes, int) or isinstance(device_memory_bytes, bool)
                or device_memory_bytes < 1):
            raise ValueError(f"device_memory_bytes must be a positive int or None; got "
                             f"{device_memory_bytes!r}")
        hw = dataclasses.replace(hw, device_memory_bytes=device_memory_bytes, reserved_bytes=0)
    per_rank = math.ceil(global_batch / world)
    rank_cfg = cfg.replace(micro_batch=per_rank, tp=1)
    layout = Layout(dp=world, pp=1, tp=1, micro_batches=1)
    results = {m: simulate_pipeline(rank_cfg, hw, 1, 1, layout.schedule, m) for m in MODES}
    table = {m: {"fits": r.fits, "step_seconds": r.step_seconds} for m, r in results.items()}
    fitting = [m for m in MODES if results[m].fits]
    if not fitting:
        need = results["none"].ranks[0]
        raise RecoveryError(
            f"no mode fits {cfg.name} on {world} rank(s) of {hw.name} "
            f"({hw.usable_bytes} bytes each): a rank takes {per_rank} of the {global_batch} "
            f"samples, {need.state_bytes} bytes of model states and {need.activation_peak_bytes} "
            f"of activations; more ranks or more memory are needed")
    mode = min(fitting, key=lambda m: (results[m].step_seconds, MODES.index(m)))
    rank = results[mode].ranks[0]
    # The budget of the engine's modes; for none and recompute the same figure (what memory
    # leaves for activations), which holds their predicted peak since they fit.
    budget = results["engine"].ranks[0].budget_bytes
    return RestartPlan(world, layout, per_rank, mode, int(budget), mode in RECOMPUTE_MODES,
                       rank.state_bytes, rank.activation_peak_bytes, rank.total_bytes,
                       hw.usable_bytes, results[mode].step_seconds, table)

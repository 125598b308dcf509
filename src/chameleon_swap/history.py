"""What ``Chameleon`` remembers of its steps: the last few ``StepStats`` and running totals.

A training run can last months of steps; keeping every step's figures would grow without bound,
so ``eng.history`` keeps the last ``history_size`` steps (default 1000) and ``eng.totals`` sums
every step since the engine was created.
"""
from __future__ import annotations

import dataclasses


class StepHistory(list):
    """A list of the last ``maxlen`` StepStats, oldest first: appending to a full history drops
    the oldest. Everything else is a plain list (indexing, slicing, iteration)."""

    def __init__(self, maxlen: int) -> None:
        super().__init__()
        self.maxlen = maxlen

    def append(self, stats) -> None:
        super().append(stats)
        if len(self) > self.maxlen:
            del self[0]


@dataclasses.dataclass
class StepTotals:
    """Sums over every step the engine ran, including those no longer in ``history``."""

    steps: int = 0
    failed_steps: int = 0
    saved_bytes: int = 0
    offloaded_bytes: int = 0
    prefetched_bytes: int = 0
    fetched_bytes: int = 0
    sync_fetches: int = 0
    forced_offloads: int = 0
    recomputed_bytes: int = 0
    stall_seconds: float = 0.0
    step_seconds: float = 0.0
    profiler_seconds: float = 0.0
    peak_resident_bytes: int = 0           # the most of any step

    def add(self, st) -> None:
        self.steps += 1
        self.failed_steps += bool(st.failed)
        for name in ("saved_bytes", "offloaded_bytes", "prefetched_bytes", "fetched_bytes",
                     "sync_fetches", "forced_offloads", "recomputed_bytes", "stall_seconds",
                     "step_seconds", "profiler_seconds"):
            setattr(self, name, getattr(self, name) + getattr(st, name))
        self.peak_resident_bytes = max(self.peak_resident_bytes, st.peak_resident_bytes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

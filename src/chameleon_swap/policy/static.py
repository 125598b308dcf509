"""``StaticPolicy`` (``policy="static"``): the contrast baseline of warm-up-frozen offload
schedules. The same planner as ``chameleon``, run once on the first timed step after warm-up;
its plan is then applied by save position to every step, whatever the step is, and never
adapted or checked. The guard underneath holds the budget when the frozen plan does not fit.
"""
from __future__ import annotations

from typing import Optional

from ..planning.cache import DEFAULT_PLAN_CACHE_SIZE, PlanEntry
from ..runtime.executor import RESIDENT, Executor, Record
from .chameleon import ChameleonPolicy
from .checks import pinned


class StaticPolicy(ChameleonPolicy):
    """Profile once after warm-up, freeze the plan, apply it by save position, never adapt."""

    name = "static"
    adaptive = False
    recomputes = False        # the frozen-schedule baseline stays swap-only
    WARMUP_STEPS = 1

    def __init__(self, ex: Executor, cache_size: int = DEFAULT_PLAN_CACHE_SIZE) -> None:
        super().__init__(ex, cache_size)
        self.frozen: Optional[PlanEntry] = None
        self._want_detail = False

    def wants_detail(self) -> bool:
        return self.frozen is None and self.step_no >= self.WARMUP_STEPS and self.ex.budget is not None

    def begin_step(self) -> None:
        self.guard.begin_step()
        self._reset_step()

    def _span_for(self, rec: Record) -> Optional[int]:
        f = self.frozen
        if f is None or rec.index >= f.n_forward:
            return None
        self._applied = f
        return rec.index                      # by position, whatever the tensor is

    def _plan(self) -> Optional[PlanEntry]:
        return self.frozen

    def after_save(self, rec: Record) -> None:
        if self.ex.budget is None:
            return
        span = self._span_for(rec)
        if span is None:
            self.guard.after_save(rec)
            return
        self._span_of[rec.index] = span
        self._rec_of[span] = rec
        if self.frozen.move[span]:
            if rec.state == RESIDENT and rec.counted:
                self.ex.offload(rec)
                self.guard._inflight.append(rec)
        else:
            self._kept.append(rec)
        if rec.index == self.frozen.n_forward - 1:
            self._forward_end()

    def end_step(self, profile=None) -> None:
        self.guard.end_step()
        self._report = {"plan_source": "planned" if self._applied is not None else "guard",
                        "predicted_stall_seconds": None if self._applied is None
                        else self._applied.predicted_stall_seconds,
                        "predicted_step_seconds": None if self._applied is None
                        else self._applied.predicted_step_seconds or None,
                        "plan_overrides": self.overrides}
        if (self.frozen is None and profile is not None and profile.detailed
                and profile.n_forward > 0 and self.ex.budget is not None):
            self.pinned_step = pinned(profile)   # (frozen from it, it predicts nothing)
            self.frozen = self._make(profile)
        self.step_no += 1

"""The schedule-aware guard: the guard, with "needed soon" read from a pipeline schedule.

The guard assumes one forward then one backward: what was saved first is needed last, so it
copies out the earliest saves and brings them back in reverse save order. A pipeline stage runs
several micro-batches' forwards before their backwards, and not in that order: under 1F1B the
first stage's micro-batch 0 is saved first and needed *first*. This policy ranks every saved
tensor by when its backward comes in this rank's schedule order (``positions``: (stage,
micro-batch) -> position of its backward), and within one micro-batch by reverse save order:

* forward: when the budget needs room, copy out the tensors whose backward is farthest away;
  those needed soon stay on the device;
* backward, and after every action of the schedule (``prefetch``): copy back in the order the
  backwards will need them, as far ahead as the budget allows, so copies start while the rank is
  still busy with other micro-batches (or waiting for a gradient from the next stage).

The owner (``chameleon_swap.parallel.pipeline``) sets ``positions`` once and ``current`` before each
action. Tensors saved with no ``current`` rank as needed last, in reverse save order: with no
schedule at all this is exactly the guard. The budget and correctness come from the executor and
the guard's mechanism, unchanged.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

from ..runtime.executor import RESIDENT, Record
from .guard import GuardPolicy

FAR = 1 << 30      # position of a backward the schedule does not name: after every named one


class ScheduleGuardPolicy(GuardPolicy):
    name = "schedule"

    def __init__(self, ex) -> None:
        super().__init__(ex)
        self.positions: dict[tuple[int, int], int] = {}
        self.current: Optional[tuple[int, int]] = None     # (stage, micro-batch) running now
        self._need: dict[Record, tuple[int, int]] = {}

    def begin_step(self) -> None:
        super().begin_step()
        self._need.clear()
        self.current = None

    def end_step(self, profile=None) -> None:
        self._need.clear()

    def report(self) -> dict:
        return {"plan_source": "schedule", "predicted_stall_seconds": None,
                "predicted_step_seconds": None, "plan_overrides": 0}

    def _key(self, rec: Record) -> tuple[int, int]:
        """Larger is needed later: (position of its backward, minus save order)."""
        key = self._need.get(rec)
        return key if key is not None else (FAR, -rec.index)

    def _tag(self, rec: Record) -> None:
        if rec not in self._need:
            pos = FAR if self.current is None else self.positions.get(self.current, FAR)
            self._need[rec] = (pos, -rec.index)

    # ------------------------------------------------------------------ forward
    def make_room(self, rec: Record) -> None:
        self._tag(rec)
        super().make_room(rec)

    def after_save(self, rec: Record) -> None:
        self._tag(rec)
        super().after_save(rec)

    def _offload_down_to(self, target: int, *, include_small: bool) -> None:
        """Start copy-outs, farthest backward first, until the bytes that stay resident once
        the copies in flight complete are at most ``target``."""
        ex = self.ex
        staying = ex.resident_bytes - ex.inflight_out_bytes
        if staying <= target:
            return
        for name in (("_large", "_small") if include_small else ("_large",)):
            queue = getattr(self, name)
            alive = [r for r in queue if r.state == RESIDENT and r.counted]
            for rec in sorted(alive, key=self._key, reverse=True):
                if staying <= target:
                    break
                ex.offload(rec)
                self._inflight.append(rec)
                staying -= rec.nbytes
            setattr(self, name, deque(r for r in alive if r.state == RESIDENT))
            if staying <= target:
                return

    # ------------------------------------------------------------------ backward
    def prefetch(self) -> None:
        """Copy back what the coming backwards need, as far as the budget allows."""
        self._prefetch()

    def _back_order(self, recs) -> list:
        """Needed first at the end of the list, like the guard's, by when the schedule's
        backwards need them."""
        return sorted(recs, key=self._key, reverse=True)

"""The guard: holds the budget on any step, seen before or not, with no profile.

Forward: when resident bytes would pass the budget, copy out the resident tensors saved earliest
(backward needs them last, so the tail of the model stays on the device: LESSONS 10), large ones
before small ones. After each save it also starts copy-outs early enough to keep room for one more
tensor of the largest size seen, so the next save rarely has to wait for a copy.

Backward: copy back in reverse save order as far ahead as the budget allows, on every unpack and on
every module's backward (the executor's triggers), so models without submodules work too.
"""
from __future__ import annotations

from collections import deque

from ..runtime.executor import HOST, OFFLOADING, RESIDENT, RESTORED, Executor, Record
from ..runtime.records import _Need


class GuardPolicy:
    name = "guard"

    def __init__(self, ex: Executor) -> None:
        self.ex = ex
        self._large: deque[Record] = deque()      # resident records in save order (lazily pruned)
        self._small: deque[Record] = deque()      # same, under min_tensor_bytes
        self._inflight: deque[Record] = deque()   # copy-outs this policy started, oldest first
        self._back: list[Record] = []             # host records by save order, for the way back
        self._back_moves = -1                     # ex.moves when _back was built
        self._largest = 0

    def begin_step(self) -> None:
        self._large.clear()
        self._small.clear()
        self._inflight.clear()
        self._back_moves = -1
        self._largest = 0

    def end_step(self, profile=None) -> None:
        pass

    def wants_detail(self) -> bool:
        return False                       # the guard needs no timings

    def report(self) -> dict:
        return {"plan_source": "guard", "predicted_stall_seconds": None,
                "predicted_step_seconds": None, "plan_overrides": 0}

    # ------------------------------------------------------------------ forward
    def make_room(self, rec: Record) -> None:
        ex = self.ex
        self._largest = max(self._largest, rec.nbytes)
        target = ex.budget - rec.nbytes
        if ex.resident_bytes <= target:
            return
        self._offload_down_to(target, include_small=True)
        # Copies are in flight; wait for the oldest until the new tensor fits.
        while ex.resident_bytes > target and self._inflight:
            old = self._inflight.popleft()
            if old.state == OFFLOADING:
                ex.wait_offload(old)

    def after_save(self, rec: Record) -> None:
        if self.ex.budget is None:
            return
        (self._small if rec.small else self._large).append(rec)
        headroom = min(self._largest, self.ex.budget // 2)
        self._offload_down_to(self.ex.budget - headroom,
                              include_small=False)

    def _offload_down_to(self, target: int, *, include_small: bool) -> None:
        """Start copy-outs, earliest saved first, until the bytes that stay resident once the
        copies in flight complete are at most ``target``."""
        ex = self.ex
        staying = ex.resident_bytes - ex.inflight_out_bytes
        for queue in ((self._large, self._small) if include_small else (self._large,)):
            while staying > target and queue:
                rec = queue.popleft()
                if rec.state == RESIDENT and rec.counted:
                    ex.offload(rec)
                    self._inflight.append(rec)
                    staying -= rec.nbytes

    # ------------------------------------------------------------------ backward
    def on_first_use(self, rec: Record) -> None:
        pass

    def on_unpack(self, rec: Record) -> None:
        self._prefetch()

    def on_backward_trigger(self) -> None:
        self._prefetch()

    def _prefetch(self) -> None:
        ex = self.ex
        if ex.budget is None:
            return
        if self._back_moves != ex.moves:
            # Something went out since the list was built (forward, a forced copy-out, a dropped
            # device copy): rebuild it once, needed first at the end.
            self._back = self._back_order(r for r in list(ex.live) if r.state in (HOST, OFFLOADING))
            self._back_moves = ex.moves
        room = ex.budget - ex.resident_bytes - ex.recompute_reserve
        back = self._back
        while back:
            rec = back[-1]
            if rec.state == OFFLOADING:
                return                 # still on its way out; its bytes are on the device anyway
            if rec.state != HOST:
                back.pop()             # fetched on demand, or released
                continue
            if rec.nbytes > room:
                return                 # keep the order: never skip ahead of what is needed next
            back.pop()
            ex.prefetch(rec)
            room -= rec.nbytes

    def _back_order(self, recs) -> list:
        """Records to copy back, the one backward needs first last: reverse save order."""
        return sorted(recs, key=lambda r: r.index)

    def make_room_backward(self, rec: Record) -> bool:
        """Room to keep a record fetched on demand: drop device copies of restored records that
        were already used (their host copy is valid, so this costs no copy)."""
        ex = self.ex
        if ex.resident_bytes + rec.nbytes <= ex.budget:
            return True
        for other in sorted((r for r in list(ex.live) if r.state == RESTORED and r is not rec),
                            key=lambda r: r.index):
            ex.drop_device_copy(other)
            if ex.resident_bytes + rec.nbytes <= ex.budget:
                return True
        # Copies out still in flight (sent late in forward, on a slow link) leave by themselves:
        # waiting for them costs the rest of their copy, not a copy back.
        for other in sorted((r for r in list(ex.live) if r.state == OFFLOADING and r is not rec),
                            key=lambda r: r.index):
            if other.state != OFFLOADING or other.out_ticket is None:
                continue     # completed or released while an earlier wait handled completions
            ex.wait_offload(other)
            if ex.resident_bytes + rec.nbytes <= ex.budget:
                return True
        if isinstance(rec, _Need):
            # A recompute's working set (a hold): forward keeps no room for it, so when a plan
            # left too much on the device (or none ran), records of this step not used yet go
            # out now, saved first (needed last) first, and come back when needed.
            for other in sorted((r for r in list(ex.live) if r.state == RESIDENT and r.counted
                                 and not r.used and r not in ex._earlier),
                                key=lambda r: r.index):
                if other.state != RESIDENT or not ex.offload(other):
                    continue     # released by an earlier wait's completions, or put off
                ex.wait_offload(other)
                if ex.resident_bytes + rec.nbytes <= ex.budget:
                    return True
        return False

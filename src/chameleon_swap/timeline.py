"""The cost model of one step: compute stream, one D2H and one H2D copy stream, a memory curve.

Pure standard library (no torch): the planner evaluates candidate plans with it, and the simulator
reuses it. It mirrors what the runtime does:

* A step is a sequence of *slots* on the compute stream: ``n_forward`` forward slots (slot ``i``
  ends with the save of span ``i``), then backward slots; a span's ``use`` is the slot at whose
  start backward first needs it (``use == n_slots``: never needed again).
* A span occupies device memory from its save to the end of its use slot. A moved span is copied
  out right after its save (D2H, one FIFO stream) and counts until that copy completes; its copy
  back is issued at the start of slot ``fetch_at`` (H2D, one FIFO stream, never before its copy
  out completed) and counts from then until the end of its use slot.
* The budget is hard, as the runtime's guard makes it: a save that would pass it waits for
  in-flight copy-outs (stall); if even that is not enough the span is copied out synchronously
  (stall = the wait for its copy). A copy back that finds no room is deferred to the first later
  slot with room; at its use it is fetched on demand (stall = its wait), counted for that slot
  when there is room, else only handed to the backward node that needs it, as the executor does.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Mapping, Optional


@dataclass(frozen=True)
class Span:
    nbytes: int
    save: int        # forward slot at whose END it is saved (0 <= save < n_forward)
    use: int         # slot at whose START backward first needs it (n_forward <= use <= n_slots)
    movable: bool = True


@dataclass(frozen=True)
class Profile:
    compute: tuple       # seconds per slot, forward then backward
    n_forward: int
    spans: tuple         # Span, in save order
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float

    @property
    def n_slots(self) -> int:
        return len(self.compute)


@dataclass(frozen=True)
class Prediction:
    peak_bytes: int
    stall_seconds: float
    total_seconds: float          # sum(compute) + stall
    lower_bound_seconds: float    # max(sum(compute), moved bytes / d2h, moved bytes / h2d)
    budget_ok: bool


@dataclass(frozen=True)
class Plan:
    move: frozenset                     # span indices copied out right after their save
    fetch_at: Mapping[int, int] = field(default_factory=dict)   # span -> slot of its copy back
    budget: Optional[int] = None
    predicted: Optional[Prediction] = None


def natural_peak(profile: Profile) -> int:
    """Peak with every span resident from its save to the end of its use slot."""
    return simulate(profile, Plan(frozenset()), None).peak_bytes


def lower_bound(profile: Profile, moved_bytes: int) -> float:
    total = float(sum(profile.compute))
    return max(total, moved_bytes / profile.d2h_bytes_per_s, moved_bytes / profile.h2d_bytes_per_s)


def simulate(profile: Profile, plan: Plan, budget: Optional[int], *, curve: Optional[list] = None
             ) -> Prediction:
    """Predict peak memory and stall of ``plan``; ``curve`` (a list) receives (time, bytes)."""
    spans = profile.spans
    n_f, n_slots = profile.n_forward, profile.n_slots
    d2h, h2d = profile.d2h_bytes_per_s, profile.h2d_bytes_per_s
    cap = float("inf") if budget is None else budget
    move = plan.move
    uses: dict[int, list[int]] = {}
    for j, sp in enumerate(spans):
        uses.setdefault(sp.use, []).append(j)
    fetch_slot: dict[int, list[int]] = {}
    for j in sorted(move, key=lambda j: (spans[j].use, j)):
        s = min(max(plan.fetch_at.get(j, spans[j].use), n_f), spans[j].use)
        fetch_slot.setdefault(s, []).append(j)

    t = 0.0
    stall = 0.0
    res = 0
    peak = 0
    d2h_free = h2d_free = 0.0
    out_done: dict[int, float] = {}
    outq: list = []                 # (done time, span) copy-outs still counted
    arrive: dict[int, float] = {}   # span -> time its copy back completes
    deferred: list[int] = []
    counted_back: set[int] = set()
    moved_bytes = 0

    def note() -> None:
        nonlocal peak
        if res > peak:
            peak = res
        if curve is not None:
            curve.append((t, res))

    def reap(now: float) -> None:
        nonlocal res
        while outq and outq[0][0] <= now:
            _, j = heapq.heappop(outq)
            res -= spans[j].nbytes
        if curve is not None:
            curve.append((now, res))

    def fetch(j: int, now: float) -> None:
        nonlocal h2d_free
        start = max(now, h2d_free, out_done[j])
        h2d_free = start + spans[j].nbytes / h2d
        arrive[j] = h2d_free

    for s in range(n_slots + 1):
        reap(t)
        # Copies back issued at the start of this slot (deferred ones first, in order).
        if s < n_slots:
            pending, deferred = deferred + fetch_slot.get(s, []), []
            for j in pending:
                if res + spans[j].nbytes <= cap:
                    res += spans[j].nbytes
                    counted_back.add(j)
                    fetch(j, t)
                    note()
                else:
                    deferred.append(j)
        # Spans needed at the start of this slot.
        for j in uses.get(s, ()):
            if j in move:
                if j not in arrive:                  # never issued: fetched on demand
                    if j in deferred:
                        deferred.remove(j)
                    if res + spans[j].nbytes <= cap:
                        res += spans[j].nbytes
                        counted_back.add(j)
                    # else: as in the executor, it is handed to the running backward node and
                    # not kept (not counted as saved-activation bytes).
                    fetch(j, t)
                    note()
                if arrive[j] > t:
                    stall += arrive[j] - t
                    t = arrive[j]
                    reap(t)
        if s == n_slots:
            break
        t += profile.compute[s]
        if s < n_f:                                  # end of a forward slot: span s is saved
            reap(t)
            sp = spans[s]
            b = sp.nbytes
            if res + b > cap:                        # wait for copy-outs in flight
                while outq and res + b > cap:
                    done, _ = outq[0]
                    stall += max(0.0, done - t)
                    t = max(t, done)
                    reap(t)
            if s in move or (res + b > cap and sp.movable):
                start = max(t, d2h_free)
                d2h_free = start + b / d2h
                out_done[s] = d2h_free
                moved_bytes += b
                if s not in move:                    # forced: copied out synchronously
                    move = move | {s}
                    fetch_slot.setdefault(sp.use, []).append(s) if sp.use < n_slots else None
                    stall += d2h_free - t
                    t = d2h_free
                else:
                    res += b
                    heapq.heappush(outq, (d2h_free, s))
                    note()
            else:
                res += b
                note()
        # End of slot s: spans used in it are released.
        for j in uses.get(s, ()):
            if j not in move or j in counted_back:
                res -= spans[j].nbytes
        if curve is not None:
            curve.append((t, res))
    total = float(sum(profile.compute)) + stall
    lb = lower_bound(profile, moved_bytes)
    return Prediction(peak_bytes=peak, stall_seconds=stall, total_seconds=total,
                      lower_bound_seconds=lb, budget_ok=budget is None or peak <= budget)


def memory_curve(profile: Profile, plan: Plan, budget: Optional[int]) -> list:
    """(time, resident bytes) points of ``plan``, for plots."""
    pts: list = []
    simulate(profile, plan, budget, curve=pts)
    return pts

"""The cost model of one step: a compute stream, one D2H and one H2D copy stream, a memory curve.

Standard library only (no torch, no numpy needed): the planner evaluates hundreds of candidate
plans with it and the simulator reuses it. It mirrors what the runtime (executor + planned policy)
does with a plan.

Slots. A step is a sequence of slots on the compute stream: ``n_forward`` forward slots (forward
slot ``i`` ends with the saves of the spans whose ``save == i``), then backward slots. A span's
``use`` is the slot at whose *start* backward first needs it; ``use == n_slots`` means never again.

Memory. A span counts from its save to the end of its use slot (to the end of the step when never
used). A moved span counts from its save until its copy-out completes, and again from when its
copy back is issued until the end of its use slot. Since every save happens in forward and every
use in backward, the natural peak is the sum of all span sizes.

Copies. D2H is one FIFO stream: a moved span's copy-out is enqueued at its save and takes
``nbytes / d2h``. H2D is one FIFO stream: copies back are issued at the start of slot ``fetch_at``
(clamped to ``[n_forward, use]``; missing means ``use``) and take ``nbytes / h2d`` each.
At one slot start the pending copies back are tried in order of (fetch slot, use, index), which is
the order in which the runtime issues them.

Decisions that mirror the runtime (the executor and ``policy/planned.py``):

* Forward budget wait. If saving a span would take resident bytes over the budget, compute waits
  for the in-flight copy-outs (FIFO, so oldest first) until it fits: that wait is stall. If it
  cannot fit even with nothing in flight (kept bytes alone are too many), the span is *forced*:
  copied out synchronously (stall = the D2H queue ahead of it + its own copy time) and never
  counted as resident, as the executor's forced offload does; its copy back is issued from the
  first backward slot on, as room allows (the guard prefetches eagerly). A span that is not
  movable is saved over the budget instead (``budget_ok`` is then False). So with every span
  movable, ``peak_bytes <= budget`` for *any* plan.
* A copy back is issued only when it fits in the budget and its copy-out has completed (the
  runtime retries a span still on its way out); otherwise it stays pending and is retried at the
  start of every later slot (later pending copies may pass it).
* At its use slot, a moved span that has not been issued yet is handled as the executor does:
  still on its way out -> its device copy is kept (no fetch, no stall); otherwise it is fetched on
  demand (stall = the H2D queue ahead of it + its copy) and counted for its use slot only - when
  it fits; without room it is only handed to the backward node that needs it (the executor does
  not count it as saved-activation bytes either). An issued copy back not arrived yet stalls
  compute by exactly the shortfall.
* Copies of spans never used again do not hold up the end of the step.

``lower_bound_seconds = max(sum(compute), F / d2h, F / h2d)`` where ``F`` is the number of bytes
copied back to the device in the prediction (each of those was copied out before and both copies
end before some slot of the step starts, on one stream each). ``total_seconds >= lower bound``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import Mapping, Optional

INF = float("inf")


@dataclass(frozen=True)
class Span:
    nbytes: int
    save: int        # forward slot at whose END it is saved (0 <= save < n_forward)
    use: int         # slot at whose START backward first needs it (n_forward <= use <= n_slots)
    movable: bool = True


@dataclass(frozen=True)
class Profile:
    compute: tuple       # seconds per slot, forward then backward; n_slots = len(compute)
    n_forward: int
    spans: tuple         # Span, in save order
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float

    def __post_init__(self) -> None:
        # Accept lists; keep the dataclass hashable and immutable.
        if not isinstance(self.compute, tuple):
            object.__setattr__(self, "compute", tuple(self.compute))
        if not isinstance(self.spans, tuple):
            object.__setattr__(self, "spans", tuple(self.spans))
        n_f, n_slots = self.n_forward, len(self.compute)
        if not 0 <= n_f <= n_slots:
            raise ValueError(f"n_forward must be in [0, {n_slots}]; got {n_f}")
        if not (self.d2h_bytes_per_s > 0 and self.h2d_bytes_per_s > 0):
            raise ValueError("bandwidths must be > 0 bytes/s; got "
                             f"d2h={self.d2h_bytes_per_s}, h2d={self.h2d_bytes_per_s}")
        for j, sp in enumerate(self.spans):
            if not (0 <= sp.save < n_f and n_f <= sp.use <= n_slots and sp.nbytes >= 0):
                raise ValueError(f"span {j} {sp} outside the timeline (n_forward={n_f}, "
                                 f"n_slots={n_slots})")

    @property
    def n_slots(self) -> int:
        return len(self.compute)

    @cached_property
    def starts(self) -> tuple:
        """Start time of every slot with no stall, and the end of the step (n_slots + 1)."""
        return (0.0, *accumulate(float(c) for c in self.compute))

    @cached_property
    def _index(self) -> tuple:
        n_slots = self.n_slots
        saves_at: list[list[int]] = [[] for _ in range(n_slots + 1)]
        uses_at: list[list[int]] = [[] for _ in range(n_slots + 1)]
        for j, sp in enumerate(self.spans):
            saves_at[sp.save].append(j)
            uses_at[sp.use].append(j)
        nbytes = [int(sp.nbytes) for sp in self.spans]
        movable = [bool(sp.movable) for sp in self.spans]
        use = [sp.use for sp in self.spans]
        return saves_at, uses_at, nbytes, movable, use


@dataclass(frozen=True)
class Prediction:
    peak_bytes: int               # max resident bytes over the step
    stall_seconds: float          # compute waiting: budget waits in forward + late copies back
    total_seconds: float          # sum(compute) + stall
    lower_bound_seconds: float    # max(sum(compute), F / d2h, F / h2d), F = bytes copied back
    budget_ok: bool               # peak_bytes <= budget (None budget -> True)
    # Additions (defaults keep positional construction with the five fields above valid).
    forward_stall_seconds: float = 0.0   # part of the stall spent waiting for room in forward
    moved_bytes: int = 0                 # bytes copied out (planned and forced)
    fetched_bytes: int = 0               # bytes copied back (F above)
    forced_offloads: int = 0             # saves that found no room even with nothing in flight
    sync_fetches: int = 0                # copies back not issued before the use slot (on demand)


@dataclass(frozen=True)
class Plan:
    move: frozenset                     # span indices copied out right after their save
    fetch_at: Mapping[int, int] = field(default_factory=dict)   # span -> slot of its copy back
    budget: Optional[int] = None
    predicted: Optional[Prediction] = None

    def __post_init__(self) -> None:
        if not isinstance(self.move, frozenset):
            object.__setattr__(self, "move", frozenset(self.move))


def natural_peak(profile: Profile) -> int:
    """Peak with every span resident from its save to the end of its use slot: every save comes
    before every release, so it is the sum of all span sizes."""
    return sum(sp.nbytes for sp in profile.spans)


def lower_bound(profile: Profile, fetched_bytes: int) -> float:
    """No schedule that copies ``fetched_bytes`` out and back again ends sooner than this."""
    return max(float(sum(profile.compute)), fetched_bytes / profile.d2h_bytes_per_s,
               fetched_bytes / profile.h2d_bytes_per_s)


# Span states inside one simulation.
_DEV, _OUT, _HOST, _BACK, _LOOSE = 0, 1, 2, 3, 4
# _DEV: on the device (never moved, or kept because its copy-out had not finished at its use);
# _OUT: copy-out in flight (counted); _HOST: only on the host; _BACK: copy back issued (counted);
# _LOOSE: fetched on demand without room (not counted).


def simulate(profile: Profile, plan: Plan, budget: Optional[int], *,
             curve: Optional[list] = None, trace: Optional[dict] = None) -> Prediction:
    """Predict peak memory, stall and total time of ``plan`` under ``budget``.

    ``curve`` (a list) receives ``(time, resident bytes)`` after every change. ``trace`` (a dict)
    receives per-span details for the planner: ``use_stall`` (span -> seconds compute waited at its
    use), ``save_stall`` (span -> seconds waited before its save), ``forced`` (list of spans),
    ``out_done`` (span -> time its copy-out completed), ``slot_start`` (actual start of each slot,
    stalls included, and the end of the step), ``deferred`` (spans whose copy back waited for
    room or for their copy-out at least once).
    """
    saves_at, uses_at, nbytes, movable, use = profile._index
    compute = profile.compute
    n_f, n_slots = profile.n_forward, len(compute)
    d2h, h2d = profile.d2h_bytes_per_s, profile.h2d_bytes_per_s
    cap = INF if budget is None else budget

    move = [False] * len(nbytes)
    for j in plan.move:
        if movable[j]:                 # a span that cannot move stays, whatever the plan says
            move[j] = True
    # Copies back per slot, each bucket in issue order (use, index).
    fetch_at = plan.fetch_at
    buckets: dict[int, list[int]] = {}
    for j in sorted((j for j in plan.move if move[j] and use[j] < n_slots),
                    key=lambda j: (use[j], j)):
        s = fetch_at.get(j, use[j])
        s = n_f if s < n_f else (use[j] if s > use[j] else s)
        buckets.setdefault(s, []).append(j)

    state = [_DEV] * len(nbytes)
    arrive = [0.0] * len(nbytes)
    outq: deque = deque()              # (done, span): copy-outs still counted, FIFO = done order
    inflight = 0                       # bytes of those
    forced_back: list[int] = []        # forced copy-outs, to be copied back from slot n_forward
    pending: list[int] = []            # copies back waiting for room / their copy-out
    scan_res, scan_out = 0, False      # resident bytes at the last scan of pending; any out?
    t = 0.0
    res = 0
    peak = 0
    stall = fstall = 0.0
    d2h_free = h2d_free = 0.0
    moved = fetched = forced_n = sync_n = 0
    tracing = trace is not None
    if tracing:
        use_stall: dict[int, float] = {}
        save_stall: dict[int, float] = {}
        forced_l: list[int] = []
        out_done_d: dict[int, float] = {}
        slot_start: list[float] = []
        deferred: set[int] = set()

    def reap(now: float) -> None:
        nonlocal res, inflight
        while outq and outq[0][0] <= now:
            done, k = outq.popleft()
            if state[k] == _OUT:
                state[k] = _HOST
                res -= nbytes[k]
                inflight -= nbytes[k]
                if curve is not None:
                    curve.append((done, res))

    for s in range(n_slots):
        if s >= n_f:
            # ---- start of a backward slot: issue copies back, then wait for what is needed.
            reap(t)
            if tracing:
                slot_start.append(t)
            new = buckets.get(s)
            if s == n_f and forced_back:
                new = sorted((new or []) + forced_back, key=lambda j: (use[j], j))
            # (Pending copies that found no room are retried only when there may be more room
            # now, or one of them was still on its way out: the result is the same, faster.)
            if new or (pending and (res < scan_res or scan_out)):
                todo = pending + new if new else pending
                pending = []
                scan_out = False
                for j in todo:
                    if state[j] != _HOST:
                        if state[j] == _OUT:
                            pending.append(j)        # still on its way out: retry later
                            scan_out = True
                            if tracing:
                                deferred.add(j)
                        continue                     # already handled at its use
                    b = nbytes[j]
                    if res + b > cap:
                        pending.append(j)
                        if tracing:
                            deferred.add(j)
                        continue
                    state[j] = _BACK
                    res += b
                    if res > peak:
                        peak = res
                    start = t if t > h2d_free else h2d_free
                    h2d_free = arrive[j] = start + b / h2d
                    fetched += b
                    if curve is not None:
                        curve.append((t, res))
                scan_res = res
            for j in uses_at[s]:
                st = state[j]
                if st == _DEV or st == _OUT:
                    if st == _OUT:                   # needed before its copy-out finished:
                        state[j] = _DEV              # the executor keeps the device copy
                        inflight -= nbytes[j]
                    continue
                b = nbytes[j]
                if st == _HOST:                      # not issued: fetched on demand now
                    sync_n += 1
                    start = t if t > h2d_free else h2d_free
                    h2d_free = arrive[j] = start + b / h2d
                    fetched += b
                    if res + b <= cap:
                        state[j] = _BACK
                        res += b
                        if res > peak:
                            peak = res
                        if curve is not None:
                            curve.append((t, res))
                    else:
                        state[j] = _LOOSE
                if arrive[j] > t:
                    w = arrive[j] - t
                    stall += w
                    t = arrive[j]
                    if tracing:
                        use_stall[j] = use_stall.get(j, 0.0) + w
                    reap(t)
        elif tracing:
            slot_start.append(t)
        t += compute[s]
        if s < n_f:
            # ---- end of a forward slot: its spans are saved.
            reap(t)
            for j in saves_at[s]:
                b = nbytes[j]
                t0 = t
                if res + b > cap:
                    if res - inflight + b > cap:
                        # Cannot fit even with nothing in flight.
                        if movable[j]:
                            # Copied out synchronously, behind the D2H queue; never counted.
                            start = t if t > d2h_free else d2h_free
                            d2h_free = start + b / d2h
                            t = d2h_free
                            reap(t)
                            state[j] = _HOST
                            moved += b
                            forced_n += 1
                            if use[j] < n_slots:
                                forced_back.append(j)
                            if tracing:
                                forced_l.append(j)
                                out_done_d[j] = t
                                save_stall[j] = t - t0
                            stall += t - t0
                            fstall += t - t0
                            continue
                        # Not movable: saved over the budget (budget_ok becomes False).
                    else:
                        while res + b > cap:         # wait for copy-outs in flight, oldest first
                            done = outq[0][0]
                            if done > t:
                                t = done
                            reap(t)
                        w = t - t0
                        stall += w
                        fstall += w
                        if tracing:
                            save_stall[j] = w
                res += b
                if res > peak:
                    peak = res
                if move[j]:
                    start = t if t > d2h_free else d2h_free
                    d2h_free = start + b / d2h
                    state[j] = _OUT
                    outq.append((d2h_free, j))
                    inflight += b
                    moved += b
                    if tracing:
                        out_done_d[j] = d2h_free
                if curve is not None:
                    curve.append((t, res))
        else:
            # ---- end of a backward slot: spans first used in it are released.
            rel = 0
            for j in uses_at[s]:
                st = state[j]
                if st == _DEV or st == _BACK:
                    rel += nbytes[j]
                state[j] = _LOOSE                    # done with it
            if rel:
                res -= rel
                if curve is not None:
                    curve.append((t, res))
    if tracing:
        slot_start.append(t)
        trace.update(use_stall=use_stall, save_stall=save_stall, forced=forced_l,
                     out_done=out_done_d,
                     slot_start=slot_start, deferred=deferred)
    total = float(sum(compute)) + stall
    return Prediction(peak_bytes=peak, stall_seconds=stall, total_seconds=total,
                      lower_bound_seconds=lower_bound(profile, fetched),
                      budget_ok=budget is None or peak <= budget,
                      forward_stall_seconds=fstall, moved_bytes=moved, fetched_bytes=fetched,
                      forced_offloads=forced_n, sync_fetches=sync_n)


def memory_curve(profile: Profile, plan: Plan, budget: Optional[int]) -> list:
    """``(time, resident bytes)`` points of ``plan`` (a step function: each point holds until the
    next), starting at ``(0, 0)``; for plots."""
    pts: list = [(0.0, 0)]
    simulate(profile, plan, budget, curve=pts)
    return pts

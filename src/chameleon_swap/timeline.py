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

Reserve. ``Profile.reserve`` gives bytes held during each slot that are not spans and never move:
the outputs selective checkpointing keeps (from the block's forward to its recompute) and the
activations a recomputed block re-creates for its backward. They count towards the peak and the
budget; spans get what the reserve leaves (``budget - reserve[slot]``), and copies back are issued
only into room that no later slot's reserve needs (the runtime keeps room for the recomputes to
come).

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
  it fits; without room it is only handed to the backward node that needs it and not counted (the
  executor does not count it as saved-activation bytes either; ``overflow_bytes`` reports the
  largest such copy). An issued copy back not arrived yet stalls compute by exactly the shortfall.
* A span needed before its copy-out completed keeps its device copy (the executor's
  ``keep_on_device``): counted to the end of its use slot, no copy back, no stall.
* Copies of spans never used again do not hold up the end of the step.

Cost: O(n log n) in the spans plus O(slots): copy-outs complete in FIFO order (a deque); pending
copies back sit in a min-segment tree over their issue order ("the first one that fits" in
O(log n)); copies back waiting for their copy-out, in a heap.

``lower_bound_seconds = max(sum(compute), F / d2h, F / h2d)`` where ``F`` is the number of bytes
copied back to the device in the prediction (each of those was copied out before and both copies
end before some slot of the step starts, on one stream each). ``total_seconds >= lower bound``.
"""
from __future__ import annotations

import heapq
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
    compute: tuple[float, ...]   # seconds per slot, forward then backward; n_slots = len(compute)
    n_forward: int
    spans: tuple[Span, ...]      # in save order
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    # Bytes held during each slot outside the spans, never movable: what selective checkpointing
    # keeps and what a recomputed block re-creates for its backward. Empty: none.
    reserve: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Accept lists; keep the dataclass hashable and immutable.
        if not isinstance(self.compute, tuple):
            object.__setattr__(self, "compute", tuple(self.compute))
        if not isinstance(self.spans, tuple):
            object.__setattr__(self, "spans", tuple(self.spans))
        if not isinstance(self.reserve, tuple):
            object.__setattr__(self, "reserve", tuple(int(r) for r in self.reserve))
        n_f, n_slots = self.n_forward, len(self.compute)
        if self.reserve and (len(self.reserve) != n_slots or min(self.reserve) < 0):
            raise ValueError(f"reserve must hold one byte count >= 0 per slot ({n_slots}); "
                             f"got {len(self.reserve)} entries")
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
    overflow_bytes: int = 0              # largest on-demand copy back kept uncounted (no room)


@dataclass(frozen=True)
class Plan:
    move: frozenset[int]                # span indices copied out right after their save
    fetch_at: Mapping[int, int] = field(default_factory=dict)   # span -> slot of its copy back
    budget: Optional[int] = None
    predicted: Optional[Prediction] = None

    def __post_init__(self) -> None:
        if not isinstance(self.move, frozenset):
            object.__setattr__(self, "move", frozenset(self.move))


def natural_peak(profile: Profile) -> int:
    """Peak with every span resident from its save to the end of its use slot: every save comes
    before every release, so it is the sum of all span sizes (plus the reserve, where a profile
    has one: then the peak is found by simulating the plan that moves nothing)."""
    if any(profile.reserve):
        return simulate(profile, Plan(frozenset()), None).peak_bytes
    return sum(sp.nbytes for sp in profile.spans)


def lower_bound(profile: Profile, fetched_bytes: int) -> float:
    """No schedule that copies ``fetched_bytes`` out and back again ends sooner than this."""
    return max(float(sum(profile.compute)), fetched_bytes / profile.d2h_bytes_per_s,
               fetched_bytes / profile.h2d_bytes_per_s)


# Span states inside one simulation.
_DEV, _OUT, _HOST, _BACK, _LOOSE = 0, 1, 2, 3, 4
# _DEV: on the device (never moved, or kept because its copy-out had not finished at its use);
# _OUT: copy-out in flight (counted); _HOST: only on the host; _BACK: copy back issued (counted);
# _LOOSE: fetched on demand without room (not counted), or released after its use slot.


def simulate(profile: Profile, plan: Plan, budget: Optional[int], *,
             curve: Optional[list] = None, trace: Optional[dict] = None) -> Prediction:
    """Predict peak memory, stall and total time of ``plan`` under ``budget``.

    ``curve`` (a list) receives ``(time, resident bytes)`` after every change. ``trace`` (a dict)
    receives per-span details for the planner: ``use_stall`` (span -> seconds compute waited at its
    use), ``save_stall`` (span -> seconds waited at its save), ``forced`` (spans copied out
    synchronously), ``out_done`` (span -> time its copy-out completed), ``slot_start`` (when each
    slot's start is reached - after earlier stalls, before waiting for the slot's own uses - then
    the end of the step), ``deferred`` (spans whose copy back was issued after its fetch slot, for
    room or because its copy-out had not ended).

    O(n log n) in the number of spans plus O(n_slots).
    """
    saves_at, uses_at, nbytes, movable, use = profile._index
    compute = profile.compute
    n_f, n_slots = profile.n_forward, len(compute)
    d2h, h2d = profile.d2h_bytes_per_s, profile.h2d_bytes_per_s
    budget_cap = INF if budget is None else budget
    reserve = profile.reserve or (0,) * n_slots
    r = 0                              # the running slot's reserve; spans get cap = budget - r
    n = len(nbytes)

    move = [False] * n
    fslot: dict[int, int] = {}         # copy-back slot of each moved span backward needs
    fetch_at = plan.fetch_at
    for j in plan.move:
        if movable[j]:                 # a span that cannot move stays, whatever the plan says
            move[j] = True
            u = use[j]
            if u < n_slots:
                f = fetch_at.get(j, u)
                fslot[j] = n_f if f < n_f else (u if f > u else f)

    state = [_DEV] * n
    out_done = [0.0] * n
    arrive = [0.0] * n
    outq: deque = deque()              # (done, span): copy-outs still counted; FIFO = done order
    inflight = 0                       # bytes of those
    t = 0.0
    res = peak = 0
    stall = 0.0
    d2h_free = h2d_free = 0.0
    moved = fetched = forced_n = sync_n = overflow = 0
    tracing = trace is not None
    use_stall: dict[int, float] = {}
    save_stall: dict[int, float] = {}
    forced_l: list[int] = []
    slot_start: list[float] = []
    deferred: set[int] = set()
    drawing = curve is not None

    def reap(now: float) -> None:
        """Copy-outs that ended by ``now`` release their device bytes."""
        nonlocal res, inflight
        while outq and outq[0][0] <= now:
            done, k = outq.popleft()
            if state[k] == _OUT:
                state[k] = _HOST
                res -= nbytes[k]
                inflight -= nbytes[k]
                if drawing:
                    curve.append((done, res + r))

    def enter(s: int) -> float:
        """The reserve of slot ``s`` takes effect: the spans' cap for the slot, the peak."""
        nonlocal r, peak
        if reserve[s] != r:
            r = reserve[s]
            if res + r > peak:
                peak = res + r
            if drawing:
                curve.append((t, res + r))
        return budget_cap - r

    # ------------------------------------------------------------------ forward
    cap = budget_cap
    for s in range(n_f):
        if tracing:
            slot_start.append(t)
        cap = enter(s)
        t += compute[s]
        if outq and outq[0][0] <= t:
            reap(t)
        for j in saves_at[s]:
            b = nbytes[j]
            if res + b > cap:
                t0 = t
                if res - inflight + b > cap:
                    # It cannot fit even with nothing in flight.
                    if movable[j]:
                        # Copied out synchronously behind the D2H queue, never counted.
                        d2h_free = (t if t > d2h_free else d2h_free) + b / d2h
                        out_done[j] = t = d2h_free
                        reap(t)
                        state[j] = _HOST
                        moved += b
                        forced_n += 1
                        if use[j] < n_slots:
                            fslot[j] = n_f       # the guard copies it back when room allows
                        stall += t - t0
                        if tracing:
                            forced_l.append(j)
                            save_stall[j] = t - t0
                        continue
                    # Not movable: saved over the budget (budget_ok becomes False).
                else:
                    while res + b > cap:         # wait for copy-outs in flight, oldest first
                        done = outq[0][0]
                        if done > t:
                            t = done
                        reap(t)
                    stall += t - t0
                    if tracing:
                        save_stall[j] = t - t0
            res += b
            if res + r > peak:
                peak = res + r
            if move[j]:
                d2h_free = (t if t > d2h_free else d2h_free) + b / d2h
                out_done[j] = d2h_free
                state[j] = _OUT
                outq.append((d2h_free, j))
                inflight += b
                moved += b
            if drawing:
                curve.append((t, res + r))
    fstall = stall

    # ------------------------------------------------------------------ backward
    # Copies back are issued only into room that no later reserve needs (the runtime keeps room
    # for the recomputes still to come): the largest reserve from each slot on.
    ahead = list(reserve)
    for s in range(n_slots - 2, -1, -1):
        if ahead[s + 1] > ahead[s]:
            ahead[s] = ahead[s + 1]
    # Copies back not issued yet, in issue order (fetch slot, use, index), as a min-segment tree
    # of their sizes: "the first pending copy that fits" in O(log n). Only copies that found no
    # room sit in it; the others are issued straight from their slot's bucket.
    w1 = n_slots + 1
    order = [x % n for x in sorted((f * w1 + use[k]) * n + k for k, f in fslot.items())]
    pos = {k: i for i, k in enumerate(order)}
    buckets: list = [None] * (n_slots + 1)
    for k in order:
        f = fslot[k]
        if buckets[f] is None:
            buckets[f] = [k]
        else:
            buckets[f].append(k)
    size = 1
    while size < len(order):
        size *= 2
    tree = [INF] * (2 * size)
    waiting: list = []                 # heap (copy-out end, span): due, but still going out

    def put(k: int, v: int) -> None:
        i = pos[k] + size
        tree[i] = v
        i >>= 1
        while i and tree[i] > v:
            tree[i] = v
            i >>= 1

    def clear(k: int) -> None:
        i = pos[k] + size
        old = tree[i]
        tree[i] = INF
        i >>= 1
        while i and tree[i] == old:
            left, right = tree[2 * i], tree[2 * i + 1]
            m = left if left < right else right
            if m == old:
                break
            tree[i] = m
            i >>= 1

    for s in range(n_f, n_slots):
        # ---- start of the slot: issue copies back, then wait for what it needs.
        if outq and outq[0][0] <= t:
            reap(t)
        if tracing:
            slot_start.append(t)
        cap = enter(s)
        issue_cap = budget_cap - ahead[s]
        if waiting and waiting[0][0] <= t:
            ready = []
            while waiting and waiting[0][0] <= t:
                k = heapq.heappop(waiting)[1]
                if state[k] == _HOST:
                    ready.append(pos[k])
            ready.sort()
            for i in ready:
                put(order[i], nbytes[order[i]])
        # Deferred copies first (they come earlier in issue order), then this slot's.
        while tree[1] != INF and res + tree[1] <= issue_cap:
            i, room = 1, issue_cap - res
            while i < size:
                v = tree[2 * i]
                i = 2 * i if v != INF and v <= room else 2 * i + 1
            j = order[i - size]
            clear(j)
            b = nbytes[j]
            state[j] = _BACK
            res += b
            if res + r > peak:
                peak = res + r
            h2d_free = arrive[j] = (t if t > h2d_free else h2d_free) + b / h2d
            fetched += b
            if tracing:
                deferred.add(j)
            if drawing:
                curve.append((t, res + r))
        bucket = buckets[s]
        if bucket is not None:
            for j in bucket:
                st = state[j]
                if st == _HOST:
                    b = nbytes[j]
                    if res + b <= issue_cap:
                        state[j] = _BACK
                        res += b
                        if res + r > peak:
                            peak = res + r
                        h2d_free = arrive[j] = (t if t > h2d_free else h2d_free) + b / h2d
                        fetched += b
                        if drawing:
                            curve.append((t, res + r))
                    else:
                        put(j, b)                    # no room: retried at later slot starts
                elif st == _OUT:
                    heapq.heappush(waiting, (out_done[j], j))   # still on its way out
                    if tracing:
                        deferred.add(j)
        for j in uses_at[s]:
            st = state[j]
            if st == _DEV:
                continue
            if st == _OUT:                           # needed before its copy-out ended:
                state[j] = _DEV                      # the executor keeps the device copy
                inflight -= nbytes[j]
                continue
            if st == _HOST:                          # not issued: fetched on demand now
                b = nbytes[j]
                sync_n += 1
                if j in pos and tree[pos[j] + size] != INF:
                    clear(j)
                if tracing and fslot.get(j, s) < s:
                    deferred.add(j)
                h2d_free = arrive[j] = (t if t > h2d_free else h2d_free) + b / h2d
                fetched += b
                if res + b <= cap:
                    state[j] = _BACK
                    res += b
                    if res + r > peak:
                        peak = res + r
                    if drawing:
                        curve.append((t, res + r))
                else:
                    state[j] = _LOOSE
                    if b > overflow:
                        overflow = b
            if arrive[j] > t:                        # not arrived yet: compute waits
                w = arrive[j] - t
                stall += w
                t = arrive[j]
                if tracing:
                    use_stall[j] = use_stall.get(j, 0.0) + w
                if outq and outq[0][0] <= t:
                    reap(t)
        t += compute[s]
        # ---- end of the slot: spans first used in it are released.
        if drawing and outq and outq[0][0] <= t:
            reap(t)                                  # (only so that curve points stay in order)
        rel = 0
        for j in uses_at[s]:
            st = state[j]
            if st == _DEV or st == _BACK:
                rel += nbytes[j]
            state[j] = _LOOSE                        # done with it
        if rel:
            res -= rel
            if drawing:
                curve.append((t, res + r))

    if tracing:
        slot_start.append(t)
        trace.update(use_stall=use_stall, save_stall=save_stall, forced=forced_l,
                     out_done={j: out_done[j] for j in range(n) if move[j] or j in fslot},
                     slot_start=slot_start, deferred=deferred)
    total = float(sum(compute)) + stall
    return Prediction(peak_bytes=peak, stall_seconds=stall, total_seconds=total,
                      lower_bound_seconds=lower_bound(profile, fetched),
                      budget_ok=budget is None or peak <= budget,
                      forward_stall_seconds=fstall, moved_bytes=moved, fetched_bytes=fetched,
                      forced_offloads=forced_n, sync_fetches=sync_n, overflow_bytes=overflow)


def memory_curve(profile: Profile, plan: Plan, budget: Optional[int]) -> list:
    """``(time, resident bytes)`` points of ``plan`` (a step function: each point holds until the
    next), starting at ``(0, 0)``; for plots."""
    pts: list = [(0.0, 0)]
    simulate(profile, plan, budget, curve=pts)
    return pts

"""The cost model's ``simulate`` as it was before it was split into one concern per piece, kept
only to prove the split changed no result: tests/planning/test_timeline.py runs both on random profiles
and compares them with ``==``. Not part of the package; do not import it from anywhere else, and
do not edit it (it is the frozen reference)."""
from __future__ import annotations

import heapq
from collections import deque
from typing import Optional

from chameleon_swap.planning.timeline import Plan, Prediction, Profile, swap_only_bound
from chameleon_swap.planning.timeline_run import INF


# Span states inside one simulation.
_DEV, _OUT, _HOST, _BACK, _LOOSE = 0, 1, 2, 3, 4
# _DEV: on the device (never moved, or kept because its copy-out had not finished at its use);
# _OUT: copy-out in flight (counted); _HOST: only on the host; _BACK: copy back issued (counted);
# _LOOSE: fetched on demand without room (not counted), or released after its use slot.


def reference_simulate(profile: Profile, plan: Plan, budget: Optional[int], *,
                       curve: Optional[list] = None,
                       trace: Optional[dict] = None) -> Prediction:
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
        if reserve[s] != r and res + reserve[s] > budget_cap and outq:
            t0 = t                     # the guard waits for copies out in flight (since 2026-11)
            while res + reserve[s] > budget_cap and outq:
                t = max(t, outq[0][0])
                reap(t)
            stall += t - t0
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
                      swap_only_bound_seconds=swap_only_bound(profile, fetched),
                      budget_ok=budget is None or peak <= budget,
                      forward_stall_seconds=fstall, moved_bytes=moved, fetched_bytes=fetched,
                      forced_offloads=forced_n, sync_fetches=sync_n, overflow_bytes=overflow)

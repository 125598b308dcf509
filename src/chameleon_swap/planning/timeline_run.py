"""How ``timeline.simulate`` runs one step, piece by piece (standard library only).

``Run`` holds one simulation's state; ``forward`` plays the forward slots (saves, copies out,
budget waits, forced copies out), then ``backward`` the backward slots (uses, stalls, releases)
with ``CopiesBack`` (the H2D stream: copies back issued at a slot's start, fetches on demand) and
``PendingCopies`` (copies back not issued yet: "the first that fits" in O(log n)). The rules they
follow are those of ``timeline``'s docstring.

``simulate`` is the planner's inner loop, called thousands of times per plan: the pieces keep what
their loops touch in local variables and hand scalars back as return values, and split only where
a call is rare (a slot with copies to issue, a copy-out ending, an on-demand fetch), because
attribute access and calls per span cost.

Why one file (over 400 lines): these pieces are one loop, cut only where calls are rare (above);
moving any of them out would add a module lookup per call to the planner's hottest path.
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Optional

INF = float("inf")


# Span states inside one simulation.
_DEV, _OUT, _HOST, _BACK, _LOOSE = 0, 1, 2, 3, 4
# _DEV: on the device (never moved, or kept because its copy-out had not finished at its use);
# _OUT: copy-out in flight (counted); _HOST: only on the host; _BACK: copy back issued (counted);
# _LOOSE: fetched on demand without room (not counted), or released after its use slot.


class Run:
    """One simulation's state: what the plan asks (``move``, ``fslot``: the copy-back slot of each
    moved span backward needs), each span's state, the D2H queue, the clock and the counters the
    forward phase hands to the backward phase, the trace. ``profile`` and ``plan`` are
    ``timeline.Profile`` and ``timeline.Plan`` (not imported: ``timeline`` imports this module)."""
    __slots__ = ("profile", "budget_cap", "reserve", "move", "fslot", "state", "out_done", "arrive",
                 "outq", "curve", "tracing", "slot_start", "save_stall", "forced", "use_stall",
                 "t", "res", "peak", "r", "inflight", "stall", "fstall", "moved", "forced_n",
                 "fetched")

    def __init__(self, profile, plan, budget: Optional[int],
                 curve: Optional[list], tracing: bool) -> None:
        _, _, nbytes, movable, use = profile._index
        n, n_slots, n_f = len(nbytes), len(profile.compute), profile.n_forward
        self.profile, self.curve, self.tracing = profile, curve, tracing
        self.budget_cap = INF if budget is None else budget
        self.reserve = profile._reserves[0]
        self.move = move = [False] * n
        self.fslot = fslot = {}
        fetch_at = plan.fetch_at
        for j in plan.move:
            if movable[j]:             # a span that cannot move stays, whatever the plan says
                move[j] = True
                u = use[j]
                if u < n_slots:
                    f = fetch_at.get(j, u)
                    fslot[j] = n_f if f < n_f else (u if f > u else f)
        self.state = [_DEV] * n
        self.out_done = [0.0] * n
        self.arrive = [0.0] * n
        self.outq: deque = deque()     # (done, span): copy-outs still counted; FIFO = done order
        self.slot_start: list[float] = []
        self.save_stall: dict[int, float] = {}
        self.forced: list[int] = []
        self.use_stall: dict[int, float] = {}
        # Set by the phases: the clock, resident bytes and the peak, the running slot's reserve
        # (spans get cap = budget - r), bytes of copies out in flight, stall (fstall: forward's),
        # bytes copied out (moved), forced copies out, bytes copied back (fetched).
        self.t = self.stall = self.fstall = 0.0
        self.res = self.peak = self.r = self.inflight = self.moved = self.forced_n = 0
        self.fetched = 0


def _reap(outq: deque, state: list, nbytes: list, now: float, res: int, inflight: int, r,
          curve: Optional[list]) -> tuple[int, int]:
    """Copy-outs that ended by ``now`` release their device bytes: resident bytes and bytes in
    flight after that."""
    while outq and outq[0][0] <= now:
        done, k = outq.popleft()
        if state[k] == _OUT:
            state[k] = _HOST
            res -= nbytes[k]
            inflight -= nbytes[k]
            if curve is not None:
                curve.append((done, res + r))
    return res, inflight


def _enter(r, res: int, peak: int, t: float, curve: Optional[list]) -> tuple:
    """A slot whose reserve ``r`` differs from the last one's starts at ``t``: its reserve and
    the peak after it."""
    if res + r > peak:
        peak = res + r
    if curve is not None:
        curve.append((t, res + r))
    return r, peak


def forward(run: Run) -> None:
    """The forward slots: each save counts and goes out when the plan moves it; a save the budget
    has no room for waits for the copies out in flight, or, when even those would not make room,
    is copied out synchronously (forced) - unless it cannot move: then it goes over the budget."""
    pr = run.profile
    saves_at, _, nbytes, movable, use = pr._index
    compute, n_f, n_slots, d2h = pr.compute, pr.n_forward, len(pr.compute), pr.d2h_bytes_per_s
    move, fslot, state, out_done, outq = run.move, run.fslot, run.state, run.out_done, run.outq
    reserve, budget_cap, curve = run.reserve, run.budget_cap, run.curve
    tracing, drawing = run.tracing, curve is not None
    slot_start, save_stall = run.slot_start, run.save_stall
    t = stall = d2h_free = 0.0
    res = peak = r = inflight = moved = forced_n = 0
    for s in range(n_f):
        if tracing:
            slot_start.append(t)
        if reserve[s] != r:
            r, peak = _enter(reserve[s], res, peak, t, curve)
        cap = budget_cap - r
        t += compute[s]
        if outq and outq[0][0] <= t:
            res, inflight = _reap(outq, state, nbytes, t, res, inflight, r, curve)
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
                        res, inflight = _reap(outq, state, nbytes, t, res, inflight, r, curve)
                        state[j] = _HOST
                        moved += b
                        forced_n += 1
                        if use[j] < n_slots:
                            fslot[j] = n_f       # the guard copies it back when room allows
                        stall += t - t0
                        if tracing:
                            run.forced.append(j)
                            save_stall[j] = t - t0
                        continue
                    # Not movable: saved over the budget (budget_ok becomes False).
                else:
                    while res + b > cap:         # wait for copy-outs in flight, oldest first
                        done = outq[0][0]
                        if done > t:
                            t = done
                        res, inflight = _reap(outq, state, nbytes, t, res, inflight, r, curve)
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
    run.t, run.res, run.peak, run.r, run.inflight = t, res, peak, r, inflight
    run.stall = run.fstall = stall
    run.moved, run.forced_n = moved, forced_n


class PendingCopies:
    """Copies back due and not issued yet. Those that found no room sit in a min-segment tree of
    their sizes over the issue order (fetch slot, use, index): "the first pending copy that fits"
    in O(log n). Those whose copy-out has not ended wait in a heap (copy-out end, span).
    ``buckets[s]``: the copies due at slot ``s``, in issue order (None when there are none)."""
    __slots__ = ("order", "pos", "buckets", "size", "tree", "waiting")

    def __init__(self, fslot: dict, use: list, n_slots: int) -> None:
        n, w1 = len(use), n_slots + 1
        self.order = order = [x % n for x in
                              sorted((f * w1 + use[k]) * n + k for k, f in fslot.items())]
        self.pos = {k: i for i, k in enumerate(order)}
        self.buckets = buckets = [None] * (n_slots + 1)
        for k in order:
            f = fslot[k]
            if buckets[f] is None:
                buckets[f] = [k]
            else:
                buckets[f].append(k)
        size = 1
        while size < len(order):
            size *= 2
        self.size = size
        self.tree = [INF] * (2 * size)
        self.waiting: list = []

    def put(self, k: int, v: int) -> None:
        tree = self.tree
        i = self.pos[k] + self.size
        tree[i] = v
        i >>= 1
        while i and tree[i] > v:
            tree[i] = v
            i >>= 1

    def clear(self, k: int) -> None:
        tree = self.tree
        i = self.pos[k] + self.size
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

    def holds(self, k: int) -> bool:
        pos = self.pos
        return k in pos and self.tree[pos[k] + self.size] != INF

    def take(self, room) -> int:
        """The first copy in the tree of at most ``room`` bytes (the caller saw that there is
        one), taken out of it."""
        tree, size = self.tree, self.size
        i = 1
        while i < size:
            v = tree[2 * i]
            i = 2 * i if v != INF and v <= room else 2 * i + 1
        k = self.order[i - size]
        self.clear(k)
        return k

    def put_due(self, now: float, state: list, nbytes: list) -> None:
        """Copies back whose copy-out ended by ``now`` join the tree (those still on the host)."""
        waiting, pos, order = self.waiting, self.pos, self.order
        ready = []
        while waiting and waiting[0][0] <= now:
            k = heapq.heappop(waiting)[1]
            if state[k] == _HOST:
                ready.append(pos[k])
        ready.sort()
        for i in ready:
            self.put(order[i], nbytes[order[i]])


class CopiesBack:
    """The H2D stream: copies back issued at a slot's start into the room no later reserve needs,
    retried at later slot starts while they find none; fetches on demand at a use."""
    __slots__ = ("pending", "state", "nbytes", "arrive", "out_done", "fslot", "h2d", "curve",
                 "tracing", "deferred", "issuing", "sync_n", "overflow")

    def __init__(self, run: Run) -> None:
        pr = run.profile
        _, _, self.nbytes, _, use = pr._index
        self.pending = pending = PendingCopies(run.fslot, use, len(pr.compute))
        self.state, self.arrive, self.out_done, self.fslot = (run.state, run.arrive, run.out_done,
                                                              run.fslot)
        self.h2d, self.curve, self.tracing = pr.h2d_bytes_per_s, run.curve, run.tracing
        self.deferred: set[int] = set()   # for the trace: issued after their fetch slot
        # What issue() reads, in one load (it runs at every slot start with copies to issue).
        self.issuing = (pending, pending.tree, pending.waiting, pending.buckets, self.state,
                        self.nbytes, self.arrive, self.out_done, self.h2d, self.curve,
                        self.tracing, self.deferred)
        self.sync_n = self.overflow = 0    # fetches on demand; the largest one left uncounted

    def issue(self, s: int, t: float, r, issue_cap, res: int, peak: int, h2d_free: float,
              fetched: int) -> tuple:
        """Slot ``s`` starts at ``t``: copies back due by now are issued, in issue order, while
        they fit in ``issue_cap``; those still going out wait for it. Takes and returns resident
        bytes, the peak, when the H2D queue empties and the bytes fetched."""
        (pending, tree, waiting, buckets, state, nbytes, arrive, out_done, h2d, curve, tracing,
         deferred) = self.issuing
        if waiting and waiting[0][0] <= t:
            pending.put_due(t, state, nbytes)
        while tree[1] != INF and res + tree[1] <= issue_cap:
            j = pending.take(issue_cap - res)
            b = nbytes[j]
            state[j] = _BACK
            res += b
            if res + r > peak:
                peak = res + r
            h2d_free = arrive[j] = (t if t > h2d_free else h2d_free) + b / h2d
            fetched += b
            if tracing:
                deferred.add(j)
            if curve is not None:
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
                        if curve is not None:
                            curve.append((t, res + r))
                    else:
                        pending.put(j, b)
                elif st == _OUT:
                    heapq.heappush(waiting, (out_done[j], j))
                    if tracing:
                        deferred.add(j)
        return res, peak, h2d_free, fetched

    def on_demand(self, j: int, s: int, t: float, r, cap, res: int, peak: int, h2d_free: float,
                  fetched: int) -> tuple:
        """Span ``j``, needed at slot ``s`` (starting at ``t``), was never issued: fetched now
        behind the H2D queue, counted for its use slot when it fits in ``cap``, else only handed
        to the node that needs it. Takes and returns what issue() does."""
        b = self.nbytes[j]
        self.sync_n += 1
        if self.pending.holds(j):
            self.pending.clear(j)
        if self.tracing and self.fslot.get(j, s) < s:
            self.deferred.add(j)
        h2d_free = self.arrive[j] = (t if t > h2d_free else h2d_free) + b / self.h2d
        fetched += b
        if res + b <= cap:
            self.state[j] = _BACK
            res += b
            if res + r > peak:
                peak = res + r
            if self.curve is not None:
                self.curve.append((t, res + r))
        else:
            self.state[j] = _LOOSE
            if b > self.overflow:
                self.overflow = b
        return res, peak, h2d_free, fetched


def backward(run: Run, back: CopiesBack) -> None:
    """The backward slots: copies back issued at each slot's start; at a use, a span still going
    out keeps its device copy, one never issued is fetched on demand, one not arrived yet stalls
    compute by the shortfall; spans first used in a slot are released at its end."""
    pr = run.profile
    _, uses_at, nbytes, _, _ = pr._index
    compute, reserve, state, arrive, outq = pr.compute, run.reserve, run.state, run.arrive, run.outq
    budget_cap, curve, tracing = run.budget_cap, run.curve, run.tracing
    drawing, slot_start, use_stall = curve is not None, run.slot_start, run.use_stall
    t, res, peak, r, inflight, stall = run.t, run.res, run.peak, run.r, run.inflight, run.stall
    ahead = pr._reserves[1]       # the largest reserve from each slot on (``Profile``)
    tree, buckets, waiting = back.pending.tree, back.pending.buckets, back.pending.waiting
    issue, on_demand = back.issue, back.on_demand
    h2d_free, fetched = 0.0, 0            # when the H2D queue empties; bytes copied back
    for s in range(pr.n_forward, len(compute)):
        # ---- start of the slot: issue copies back, then wait for what it needs.
        if outq and outq[0][0] <= t:
            res, inflight = _reap(outq, state, nbytes, t, res, inflight, r, curve)
        if tracing:
            slot_start.append(t)
        if reserve[s] != r:
            if res + reserve[s] > budget_cap and outq:
                # A recompute's working set finds too little room: the guard waits for copies
                # out in flight (``make_room_backward``), oldest first; that wait is stall.
                t0 = t
                while res + reserve[s] > budget_cap and outq:
                    t = max(t, outq[0][0])
                    res, inflight = _reap(outq, state, nbytes, t, res, inflight, r, curve)
                stall += t - t0
            r, peak = _enter(reserve[s], res, peak, t, curve)
        cap = budget_cap - r
        issue_cap = budget_cap - ahead[s]
        if (buckets[s] is not None or (waiting and waiting[0][0] <= t)
                or (tree[1] != INF and res + tree[1] <= issue_cap)):
            res, peak, h2d_free, fetched = issue(s, t, r, issue_cap, res, peak, h2d_free, fetched)
        for j in uses_at[s]:
            st = state[j]
            if st == _DEV:
                continue
            if st == _OUT:                           # needed before its copy-out ended:
                state[j] = _DEV                      # the executor keeps the device copy
                inflight -= nbytes[j]
                continue
            if st == _HOST:
                res, peak, h2d_free, fetched = on_demand(j, s, t, r, cap, res, peak, h2d_free,
                                                         fetched)
            if arrive[j] > t:                        # not arrived yet: compute waits
                w = arrive[j] - t
                stall += w
                t = arrive[j]
                if tracing:
                    use_stall[j] = use_stall.get(j, 0.0) + w
                if outq and outq[0][0] <= t:
                    res, inflight = _reap(outq, state, nbytes, t, res, inflight, r, curve)
        t += compute[s]
        # ---- end of the slot: spans first used in it are released.
        if drawing and outq and outq[0][0] <= t:     # (only so that curve points stay in order)
            res, inflight = _reap(outq, state, nbytes, t, res, inflight, r, curve)
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
    run.t, run.res, run.peak, run.r, run.inflight, run.stall = t, res, peak, r, inflight, stall
    run.fetched = fetched

"""The swap planner: a pure function from a profile, a budget and bandwidths to a Plan.

Chameleon plans from limited operator information (arXiv 2509.11076): which saved tensors to copy
out after their save and when each copy back starts, so that the step stays under its budget with
the least stall. Every candidate is judged by the timeline model (``timeline.simulate``, about a
millisecond for 300 spans), so the search is greedy plus local improvement, not exact:

1. Nothing moves when the unmoved peak (``timeline.unmoved_peak``) fits (or there is no budget).
2. Every span is live across the peak (all saves come before all uses), so about
   ``unmoved peak - budget`` bytes must be out around the end of forward. Candidates are ranked
   four ways: by idle window (compute between save and first use), by window over copy time, by
   save order, and large tensors whose copies hide first. Spans saved last and needed first have
   no window and rank last, so the tail stays resident (LESSONS 10).
3. For each ranking, its prefixes are walked out from ``k0``, the shortest that covers the excess:
   a doubling ladder up and down (fewer moves can win: the forced synchronous copy of a late save
   may cost less than a copy that does not hide), then a ternary search around the best rung.
4. Local improvement from each ranking's best prefix (only the best on large profiles): passes of
   single add / remove / swap moves, chosen from the ranking's boundary and from where the
   prediction stalls (late copies back: remove; waits in forward: add spans saved earlier).
   A change is kept when it lowers the predicted total (ties: fewer moves where they cost the
   host, then fewer bytes).
5. Copies back: each is issued as late as it still arrives in time - a backward pass from the
   last use on the single FIFO H2D stream (``fetch_schedule``) - and the model defers one that
   finds no room, as the runtime does. When copies back still come late, the guard's way (every
   copy back from the first backward slot, as room allows) is tried too. Then a coordinate
   descent on the copy-back slots (all slots on small profiles, a few earlier ones for the
   latest copies on large ones), and one slot of margin against timing noise wherever it costs
   nothing predicted.
6. Never worse than moving nothing (the guard's forced copies in the same model).

Cost: bounded by ``max_evals`` simulations (default ``DEFAULT_WORK // spans``, so about the same
time whatever the size). Deterministic: no randomness; every iteration over spans is sorted.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import replace
from typing import Optional

from .timeline import Plan, Prediction, Profile, simulate, unmoved_peak

DEFAULT_MAX_PASSES = 3
DEFAULT_WORK = 60_000        # simulate() calls x spans per plan(): 200 calls for 300 spans
DEFAULT_MIN_EVALS = 120
DEFAULT_MAX_EVALS = 2_000
SMALL = 12                   # up to this many movable spans, local search tries every neighbour
LARGE = 64                   # above this many spans, local search starts from LARGE_STARTS
LARGE_STARTS = 1             # prefix(es) only, and copy-back tuning is limited


def plan(profile: Profile, budget: Optional[int], *, max_passes: int = DEFAULT_MAX_PASSES,
         max_evals: Optional[int] = None) -> Plan:
    """The plan with the least predicted total time found, ``predicted`` filled in.
    ``max_passes`` bounds the local-improvement passes; ``max_evals`` the simulations (default
    ``DEFAULT_WORK // spans`` within [DEFAULT_MIN_EVALS, DEFAULT_MAX_EVALS]: a simulation costs
    time in proportion to the spans)."""
    if budget is None or unmoved_peak(profile) <= budget:
        return Plan(frozenset(), {}, budget, simulate(profile, Plan(frozenset()), budget))
    if max_evals is None:
        max_evals = min(DEFAULT_MAX_EVALS,
                        max(DEFAULT_MIN_EVALS, DEFAULT_WORK // max(1, len(profile.spans))))
    # A move's host cost prices the plan (the mode search compares mixes by it), not the search
    # (charged there, it traded planned copies for the guard's and for plans with no slack), but
    # breaks its ties (by bytes, the CPU demo's Llama moved 23 small tensors: 58.4 ms priced,
    # where 4 of 344 KiB hid as well: 55.6 ms).
    priced = bool(profile.move_seconds)
    search = replace(profile, move_seconds=0.0) if priced else profile
    found = _Search(search, budget, max_evals, priced).run(max_passes)
    return Plan(found.move, found.fetch_at, budget, simulate(profile, found, budget)) if priced \
        else found


# ---------------------------------------------------------------------------- rankings
def windows(profile: Profile) -> list[float]:
    """Compute seconds between each span's save and its first use (to the step end if none)."""
    st = profile.starts
    return [st[sp.use] - st[sp.save + 1] for sp in profile.spans]


def copy_seconds(profile: Profile, j: int) -> float:
    sp = profile.spans[j]
    out = sp.nbytes / profile.d2h_bytes_per_s
    return out + (sp.nbytes / profile.h2d_bytes_per_s if sp.use < profile.n_slots else 0.0)


def _candidates(profile: Profile) -> list[int]:
    return [j for j, sp in enumerate(profile.spans) if sp.movable and sp.nbytes > 0]


def rank(profile: Profile) -> list[int]:
    """Movable spans, best candidates first: idle window over copy time, then size."""
    win = windows(profile)

    def ratio(j: int) -> float:
        c = copy_seconds(profile, j)
        return win[j] / c if c > 0 else float("inf")
    return sorted(_candidates(profile), key=lambda j: (-ratio(j), -profile.spans[j].nbytes, j))


def rankings(profile: Profile) -> list[list[int]]:
    """The candidate orders the prefix search walks (duplicates removed)."""
    win = windows(profile)
    cand = _candidates(profile)
    nb = [sp.nbytes for sp in profile.spans]
    by_ratio = rank(profile)
    by_window = sorted(cand, key=lambda j: (-win[j], -nb[j], j))
    by_save = sorted(cand, key=lambda j: (profile.spans[j].save, j))
    hides = {j for j in cand if win[j] >= copy_seconds(profile, j)}
    big_hidden = (sorted((j for j in cand if j in hides), key=lambda j: (-nb[j], j))
                  + [j for j in by_ratio if j not in hides])
    out: list[list[int]] = []
    for order in (by_window, by_ratio, by_save, big_hidden):
        if order not in out:
            out.append(order)
    return out


# ---------------------------------------------------------------------------- copy-back times
def fetch_schedule(profile: Profile, move, margin_slots: int = 0) -> dict[int, int]:
    """As-late-as-possible copy-back slot of each span of ``move``.

    Walks back from the last use: each copy must end by its use (slot start times without stall)
    and before the next copy on the FIFO H2D stream starts; it is issued at the latest slot start
    not after its own start, then ``margin_slots`` earlier, never before ``n_forward``. Spans
    never used again get ``use`` (no copy back).
    """
    spans = profile.spans
    return _alap(profile, sorted(move, key=lambda j: (spans[j].use, j), reverse=True),
                 margin_slots)


def _alap(profile: Profile, latest_first, margin_slots: int = 0) -> dict[int, int]:
    """``fetch_schedule`` of spans given latest use first."""
    n_f, n_slots = profile.n_forward, profile.n_slots
    st = profile.starts
    h2d = profile.h2d_bytes_per_s
    spans = profile.spans
    out: dict[int, int] = {}
    next_start = float("inf")
    for j in latest_first:
        sp = spans[j]
        u = sp.use
        if u >= n_slots:
            out[j] = u
            continue
        deadline = st[u] if st[u] < next_start else next_start
        begin = deadline - sp.nbytes / h2d
        next_start = begin
        slot = bisect_right(st, begin + 1e-12 * (1.0 + abs(begin)), 0, u + 1) - 1 - margin_slots
        out[j] = u if slot > u else (n_f if slot < n_f else slot)
    return out


# ---------------------------------------------------------------------------- search
class _Search:
    def __init__(self, profile: Profile, budget: int, max_evals: int,
                 fewer_moves: bool = False) -> None:
        self.pr, self.fewer_moves, self.budget = profile, fewer_moves, budget
        self.max_evals, self.evals = max(1, max_evals), 0
        self.nbytes = [sp.nbytes for sp in profile.spans]
        self.cache: dict[frozenset, tuple] = {}
        self.eager_too = len(profile.spans) <= LARGE
        self.scale = max(float(sum(profile.compute)), 1e-12)
        spans = profile.spans
        self.latest_first = sorted(range(len(spans)), key=lambda j: (spans[j].use, j),
                                   reverse=True)

    # A plan's score: budget first, then predicted time (equal within 1e-10 of the step's
    # compute), then moves where each costs the host (``plan``), then bytes (not free either).
    def key(self, pred: Prediction, move) -> tuple:
        return (not pred.budget_ok, round(pred.total_seconds / self.scale, 10),
                len(move) if self.fewer_moves else 0, sum(self.nbytes[j] for j in move))

    def out_of_evals(self) -> bool:
        return self.evals >= self.max_evals

    def score(self, move: frozenset) -> tuple:
        """(key, fetch_at, prediction, trace) of ``move`` with the ALAP copy-back schedule (or
        the eager one when that is better), memoised."""
        hit = self.cache.get(move)
        if hit is None:
            fetch = _alap(self.pr, [j for j in self.latest_first if j in move])
            hit = self._eval(move, fetch)
            if hit[2].stall_seconds > hit[2].forward_stall_seconds and self.eager_too:
                # Copies back came late: when the H2D stream or the room is the bottleneck,
                # issuing every copy back as early as room allows (the guard's way) can win.
                n_f = self.pr.n_forward
                eager = {j: (n_f if self.pr.spans[j].use < self.pr.n_slots else s)
                         for j, s in fetch.items()}
                if eager != fetch:
                    other = self._eval(move, eager)
                    if other[0] < hit[0]:
                        hit = other
            self.cache[move] = hit
        return hit

    def _eval(self, move: frozenset, fetch: dict) -> tuple:
        trace: dict = {}
        pred = simulate(self.pr, Plan(move, fetch, self.budget), self.budget, trace=trace)
        self.evals += 1
        return (self.key(pred, move), fetch, pred, trace)

    # -------------------------------------------------------------- 3. prefixes of rankings
    def best_prefix(self, order: list[int], k0: int) -> list[tuple[tuple, frozenset]]:
        n = len(order)
        tried: dict[int, tuple] = {}

        def at(k: int) -> tuple:
            if k not in tried:
                tried[k] = self.score(frozenset(order[:k]))[0]
            return tried[k]
        # A ladder out from k0 both ways (fewer moves can win: forced copies of the last saves
        # may cost less than planned copies that do not hide), each way until it worsens twice.
        up, down = [k0], []
        step = 1
        while up[-1] < n:
            up.append(min(n, k0 + step))
            step *= 2
        step = 1
        while k0 - step > 0:
            down.append(k0 - step)
            step *= 2
        if k0 > 0:
            down.append(0)
        best_k = None
        for side in (up, down):
            worse = 0
            for k in side:
                if self.out_of_evals() and tried:
                    break
                if best_k is None or at(k) < at(best_k):
                    best_k, worse = k, 0
                else:
                    worse += 1
                    if worse >= 2:
                        break
        ladder = sorted(tried)
        # Ternary search between the rungs around the best (the total is roughly unimodal in k).
        i = ladder.index(best_k)
        lo = ladder[i - 1] if i > 0 else best_k
        hi = ladder[i + 1] if i + 1 < len(ladder) else best_k
        while hi - lo > 2 and not self.out_of_evals():
            m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
            if at(m1) <= at(m2):
                hi = m2
            else:
                lo = m1
        for k in range(lo, hi + 1):
            if self.out_of_evals():
                break
            if at(k) < at(best_k):
                best_k = k
        out = [(tried[best_k], frozenset(order[:best_k]))]
        # Also the best prefix that covers the excess by itself: another start for the local
        # search (fewer moves can be better, and still far from the best set with more).
        cover = [k for k in tried if k >= k0]
        if best_k < k0 and cover:
            kc = min(cover, key=lambda k: (tried[k], k))
            out.append((tried[kc], frozenset(order[:kc])))
        return out

    # -------------------------------------------------------------- 4. local improvement
    def neighbours(self, best: frozenset, order: list[int]) -> list[frozenset]:
        """Single add / remove / swap moves, the most promising first."""
        _, _, _, tr = self.score(best)
        pos = {j: i for i, j in enumerate(order)}
        inside = sorted(best, key=lambda j: pos[j])
        outside = [j for j in order if j not in best]
        if len(order) <= SMALL:
            rem, add = inside[::-1], outside
            swaps = [(i, j) for i in rem for j in add]
        else:
            # Removals: spans whose copy back came late, then the worst ranked.
            late = sorted(tr["use_stall"], key=lambda j: (-tr["use_stall"][j], j))
            rem = _unique([j for j in late if j in best] + inside[::-1][:4])[:6]
            # Additions: the best ranked left out, first among those saved before a budget wait.
            waits = [j for j in tr["save_stall"]] + list(tr["forced"])
            first_wait = min((self.pr.spans[j].save for j in waits), default=None)
            early = ([j for j in outside if self.pr.spans[j].save < first_wait][:4]
                     if first_wait is not None else [])
            add = _unique(early + outside[:4])[:6]
            nb = self.nbytes
            swaps = []
            for i in rem[:3]:
                # Swap with the left-out spans closest in size, among the best ranked.
                near = sorted(outside[:24], key=lambda j: (abs(nb[j] - nb[i]), pos[j]))[:3]
                swaps += [(i, j) for j in near]
        moves = [best - {j} for j in rem] + [best | {j} for j in add]
        moves += [(best - {i}) | {j} for i, j in swaps]
        return moves

    def improve(self, best: frozenset, order: list[int], max_passes: int) -> frozenset:
        for _ in range(max(0, max_passes)):
            improved = False
            for cand in self.neighbours(best, order):
                if self.out_of_evals():
                    return best
                if self.score(cand)[0] < self.score(best)[0]:
                    best, improved = cand, True
                    break      # neighbours of the new best (its trace) next
            if not improved:
                break
        return best

    # -------------------------------------------------------------- 5. copy-back times
    def tune_fetch(self, move: frozenset, passes: int = 2) -> tuple[tuple, dict, Prediction]:
        """Coordinate descent on copy-back slots, from the ALAP (or eager) schedule: every slot
        of every copy back on small profiles; on large ones, a few earlier slots for the copies
        that came latest."""
        pr, budget = self.pr, self.budget
        key, fetch, pred, tr = self.score(move)
        fetch = dict(fetch)
        n_f, n_slots = pr.n_forward, pr.n_slots
        spans = pr.spans
        small = len(spans) <= SMALL
        if small:
            todo = sorted((j for j in fetch if spans[j].use < n_slots),
                          key=lambda j: (spans[j].use, j))
        else:
            todo = [j for j in sorted(tr["use_stall"], key=lambda j: (-tr["use_stall"][j], j))
                    if j in fetch][:6]
        for _ in range(passes):
            improved = False
            for j in todo:
                if small:
                    slots = range(n_f, spans[j].use + 1)
                else:
                    slots = sorted({max(n_f, fetch[j] - d) for d in (1, 2, 4)} | {n_f})
                for c in slots:
                    if c == fetch[j] or self.out_of_evals():
                        continue
                    trial = dict(fetch)
                    trial[j] = c
                    p = simulate(pr, Plan(move, trial, budget), budget)
                    self.evals += 1
                    k = self.key(p, move)
                    if k < key:
                        key, fetch, pred, improved = k, trial, p, True
            if not improved:
                break
        # A slot of margin against timing noise wherever it costs nothing predicted.
        if not self.out_of_evals():
            trial = {j: (max(n_f, s - 1) if spans[j].use < n_slots else s)
                     for j, s in fetch.items()}
            if trial != fetch:
                p = simulate(pr, Plan(move, trial, budget), budget)
                self.evals += 1
                if self.key(p, move) <= key:
                    fetch, pred = trial, p
        return key, fetch, pred

    def run(self, max_passes: int) -> Plan:
        pr, budget = self.pr, self.budget
        excess = unmoved_peak(pr) - budget
        starts: dict[frozenset, tuple] = {}
        for order in rankings(pr):
            if not order:
                continue
            acc, k0 = 0, len(order)
            for i, j in enumerate(order):
                acc += self.nbytes[j]
                if acc >= excess:
                    k0 = i + 1
                    break
            for k, move in self.best_prefix(order, k0):
                if move not in starts:
                    starts[move] = (k, order)
        # Local improvement from each ranking's best prefix, the most promising first.
        best, best_key = frozenset(), self.score(frozenset())[0]
        ranked = sorted(starts.items(), key=lambda kv: (kv[1][0], sorted(kv[0])))
        if len(self.pr.spans) > LARGE:
            ranked = ranked[:LARGE_STARTS]   # large profiles: the evaluations go to the best
        for move, (k, order) in ranked:
            spent = self.out_of_evals()      # then improve returns the start, scored already:
            cand = self.improve(move, order, max_passes)      # still a candidate, the last one
            if self.score(cand)[0] < best_key:
                best, best_key = cand, self.score(cand)[0]
            if spent:
                break
        # Copy-back times of the best (on small profiles, of the best six move sets).
        finals = [best]
        if len(pr.spans) <= SMALL:
            finals += [m for m, _ in sorted(self.cache.items(),
                                            key=lambda kv: (kv[1][0], sorted(kv[0])))
                       if m != best][:5]
        key = None
        for m in finals:
            k, f, p = self.tune_fetch(m)
            if key is None or k < key:
                key, fetch, pred, best = k, f, p, m
        # Never worse than moving nothing (the guard's forced copies, in the same model).
        empty = simulate(pr, Plan(frozenset(), {}, budget), budget)
        if self.key(empty, ()) <= key:
            return Plan(frozenset(), {}, budget, empty)
        return Plan(best, fetch, budget, pred)


def _unique(xs: list[int]) -> list[int]:
    seen: set[int] = set()
    return [x for x in xs if not (x in seen or seen.add(x))]

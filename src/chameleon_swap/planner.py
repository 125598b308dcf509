"""The swap planner: a pure function from a profile, a budget and bandwidths to a Plan.

Chameleon plans from limited operator information (arXiv 2509.11076): which saved tensors to move
and when each copy back starts, so the step stays under its budget with the least stall. This
planner works on the timeline model (``timeline.simulate``), which is cheap enough to evaluate a few
hundred candidate plans:

1. Nothing moves if the natural peak fits.
2. Candidates are ranked by how well their copies hide: the compute between a span's save and its
   first use (its idle window) against the time its two copies take, larger spans first among
   equals. Spans saved last and needed first have no window and rank last, so they stay resident
   (LESSONS 10).
3. The number of top-ranked spans to move is chosen by evaluating a ladder of prefixes; then a few
   passes of single add / remove moves keep any change that lowers the predicted total time.
4. Each copy back is issued as late as it can still arrive in time (one slot of margin), walking
   back from the last use so the H2D stream's FIFO queueing is accounted for.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Optional

from .timeline import Plan, Prediction, Profile, simulate

DEFAULT_MAX_EVALS = 160


def plan(profile: Profile, budget: Optional[int], *, max_evals: int = DEFAULT_MAX_EVALS) -> Plan:
    empty = Plan(frozenset(), {}, budget)
    base = simulate(profile, empty, budget)
    if budget is None or (base.budget_ok and base.stall_seconds == 0.0):
        return Plan(frozenset(), {}, budget, base)
    order = rank(profile)
    evals = [0]
    cache: dict[frozenset, tuple[Plan, Prediction]] = {}

    def score(move: frozenset) -> tuple[Plan, Prediction]:
        hit = cache.get(move)
        if hit is None:
            p = Plan(move, fetch_schedule(profile, move), budget)
            hit = cache[move] = (p, simulate(profile, p, budget))
            evals[0] += 1
        return hit

    nbytes = [sp.nbytes for sp in profile.spans]

    def key(pred: Prediction, move: frozenset = frozenset()) -> tuple:
        # Among plans predicted equally fast, move the fewest bytes: copies are not free (host
        # memory bandwidth, and on a CPU device the copy threads share the cores with compute).
        return (not pred.budget_ok, round(pred.total_seconds, 9), sum(nbytes[j] for j in move))

    # Ladder of prefixes of the ranking, then refine around the best.
    n = len(order)
    ks = sorted({0, n, *(round(n * f) for f in (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9))})
    def k_key(k: int) -> tuple:
        m = frozenset(order[:k])
        return key(score(m)[1], m)

    best_k = min(ks, key=k_key)
    lo, hi = max(0, best_k - max(1, n // 10)), min(n, best_k + max(1, n // 10))
    step = max(1, (hi - lo) // 12)
    for k in range(lo, hi + 1, step):
        if evals[0] >= max_evals // 2:
            break
        if k_key(k) < k_key(best_k):
            best_k = k
    best = frozenset(order[:best_k])
    # Local improvement: add or remove single spans near the boundary of the ranking.
    window = order[max(0, best_k - 8): best_k + 8]
    improved = True
    while improved and evals[0] < max_evals:
        improved = False
        for j in window:
            if evals[0] >= max_evals:
                break
            cand = best - {j} if j in best else best | {j}
            if key(score(cand)[1], cand) < key(score(best)[1], best):
                best, improved = cand, True
    p, pred = score(best)
    if key(base) <= key(pred, best):
        return Plan(frozenset(), {}, budget, base)
    return Plan(p.move, p.fetch_at, budget, pred)


def rank(profile: Profile) -> list[int]:
    """Movable spans, best candidates first: idle window / copy time, then size."""
    starts = [0.0, *accumulate(profile.compute)]
    d2h, h2d = profile.d2h_bytes_per_s, profile.h2d_bytes_per_s
    scored = []
    for j, sp in enumerate(profile.spans):
        if not sp.movable or sp.nbytes == 0:
            continue
        use = min(sp.use, profile.n_slots)
        window = starts[use] - starts[sp.save + 1]
        copy = sp.nbytes / d2h + sp.nbytes / h2d
        scored.append((-(window / copy if copy > 0 else float("inf")), -sp.nbytes, j))
    scored.sort()
    return [j for _, _, j in scored]


def fetch_schedule(profile: Profile, move: frozenset, margin_slots: int = 1) -> dict[int, int]:
    """As-late-as-possible copy-back slots for ``move``, FIFO on one H2D stream, from compute-only
    slot start times, issued ``margin_slots`` earlier for safety."""
    n_f, n_slots = profile.n_forward, profile.n_slots
    starts = [0.0, *accumulate(profile.compute)]
    h2d = profile.h2d_bytes_per_s
    out: dict[int, int] = {}
    next_start = float("inf")
    for j in sorted(move, key=lambda j: (profile.spans[j].use, j), reverse=True):
        sp = profile.spans[j]
        if sp.use >= n_slots:
            out[j] = n_slots
            continue
        deadline = min(starts[sp.use], next_start)
        begin = deadline - sp.nbytes / h2d
        next_start = begin
        slot = sp.use
        while slot > n_f and starts[slot] > begin:
            slot -= 1
        out[j] = max(n_f, slot - margin_slots)
    return out

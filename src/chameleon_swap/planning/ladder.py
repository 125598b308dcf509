"""The count to convert: the least of a score roughly unimodal in an integer ``k`` in ``[0, n]``.

Both block-mode searches ask it: the mode search (``modes.py``: how many blocks of a family
convert) and the simulator's pipeline planner (how many blocks per stage). Pure, like the rest
of ``planning/``.
"""
from __future__ import annotations

from typing import Callable


def best_count(score: Callable[[int], tuple], n: int) -> int:
    """The ``k`` in ``[0, n]`` with the least ``score(k)`` (ties: the smaller ``k``), for a score
    roughly unimodal in ``k``: a geometric ladder 0, 1, 2, 4, ..., n, then a ternary search
    between the rungs around the best. Each ``k`` is scored at most once."""
    tried: dict[int, tuple] = {}

    def at(k: int) -> tuple:
        if k not in tried:
            tried[k] = score(k)
        return tried[k]
    ladder = sorted({0, n} | {min(n, 2 ** i) for i in range(n.bit_length() + 1)})
    best = min(ladder, key=lambda k: (at(k), k))
    i = ladder.index(best)
    lo = ladder[i - 1] if i > 0 else best
    hi = ladder[i + 1] if i + 1 < len(ladder) else best
    while hi - lo > 2:
        m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if at(m1) <= at(m2):
            hi = m2
        else:
            lo = m1
    return min((*range(lo, hi + 1), best), key=lambda k: (at(k), k))

"""The quiet mix: kept and fully recomputed blocks only, nothing moved. Pure, like ``modes.py``.

A plan made from figures the engine does not trust yet (the engine's first step, a warm-up; a
size's view scaled from another size's) runs a mix that moves nothing and recomputes nothing
selectively (``policy/mix_runs.until_warm``): the copies such figures predict are guesses (on the
CPU demo a scaled view's mix ran 1.3-1.7x its prediction; on an H200, plans from the first step
kept every block and ran 3-9x checkpointing's step time). Only that mix is needed then, and it
needs no swap search: a mix that moves nothing is one simulation. ``plan_quiet`` finds it along
the mode search's conversion order (the blocks whose activations wait the least in the link's
window convert first) and along its reverse: every count of converted blocks whose unmoved peak
fits the budget is simulated, the least predicted time wins (ties: fewer recomputed). On the
demo's model its search cost 1-5 ms where the full mode search (whose result such a plan would
not run) cost 24-72 ms.
"""
from __future__ import annotations

from typing import Optional, Sequence

from .modes import Block, HybridPlan, _made, apply_modes, conversion_order, recomputable
from .swaps import plan as plan_swaps
from .timeline import Profile, unmoved_peak


def plan_quiet(profile: Profile, blocks: Sequence[Block], budget: int) -> Optional[HybridPlan]:
    """The fastest mix of kept and fully recomputed blocks that fits ``budget`` moving nothing,
    with its prediction; None where none does (then only the full search can say what runs)."""
    keep = tuple("keep" for _ in blocks)
    if unmoved_peak(profile) <= budget:
        return _made(profile, blocks, keep, plan_swaps(profile, budget))
    order = conversion_order(profile, recomputable(profile, blocks, budget))
    best: dict = {}
    # Two orders: the mode search's, and its reverse (the first blocks in forward order: their
    # recomputes run at the end of backward, when little else is held, so each frees more of
    # the peak than a late block's, whose recompute runs while everything is still held).
    for seq in (order, order[::-1]):
        for k in range(len(seq), 0, -1):     # most recomputed first: the first count that does
            modes = list(keep)               # not fit ends the order's search
            for b in seq[:k]:
                modes[b] = "full"
            modes = tuple(modes)
            if modes in best:
                continue
            view = apply_modes(profile, blocks, modes)
            if unmoved_peak(view) > budget:
                break
            best[modes] = (view, plan_swaps(view, budget))    # (fits: moves nothing)
    if not best:
        return None
    modes = min(best, key=lambda m: (best[m][1].predicted.total_seconds, m.count("full"), m))
    view, plan = best[modes]
    return _made(view, blocks, modes, plan, profile)

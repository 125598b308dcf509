"""What the mode search reads for a mix that never ran at a size: its prediction times the ratio
the mixes that did run there missed by. Pure, like the rest of ``planning/``.

A model is a model, and its misses have two sources. Compute, which every mix shares: a mix that
keeps and fully recomputes blocks and moves nothing (a *quiet* mix) misses on that alone. And
what the model knows least, which only some mixes meet: whether copies hide behind compute, what
selective checkpointing holds. A mix that copies or recomputes selectively (a *moving* mix) can
miss on those too, and by far more (HF Llama 256x4 at 25% of its peak, 384 tokens, on the
emulated link: all four blocks full ran 0.202 s, as predicted; two kept and two full, moving
10.7 MB, was predicted 0.205 s and ran 0.344 s; the size tried four mixes in twelve visits and
ran 1.63x of the plain step where full recomputation ran 1.31x).

So from ``MIN_CALIBRATION_RUNS`` mixes that ran on, a mix that did not is read at the least
ratio of measured over predicted among them (the benefit of the doubt: some mixes ran slow for
reasons of their own), and a moving one at the least ratio among the *moving* mixes that ran,
where any did (never below the first, the least of all): once every moving mix tried at a size
ran well above its prediction, the next moving mix the model favours is read as missing as they
did, and a quiet mix that ran as predicted keeps the size.
"""
from __future__ import annotations

from typing import Iterable

CALIBRATION_CLAMP = (0.5, 2.0)   # measured over predicted step time, believed within
MIN_CALIBRATION_RUNS = 2         # mixes that ran before their ratio calibrates the others


def moving(modes, predicted) -> bool:
    """Whether a mix (block ``modes``, its swap plan's ``predicted``) is a moving one: it copies
    or recomputes selectively, where the model is least sure."""
    return bool(predicted.moved_bytes) or "selective" in modes


LIGHT_SHARE = 0.05      # a fallback may copy for this share of its predicted step on the link


def light(modes, predicted, bytes_per_s: float, unavoidable: int) -> bool:
    """Whether a mix is quiet but for copies no mix avoids: no block recomputed selectively, and
    it moves no more than ``unavoidable`` (what all full moves: the least saved), within
    ``LIGHT_SHARE`` of its predicted step on the link (``bytes_per_s``, its slower direction).
    Such a mix can stand as a plan's fallback (``HybridPlan.fallback``). Where a budget leaves
    room for little but recomputed blocks' inputs, all full still copies saves no recompute
    drops (a Llama's logits): on the emulated link, HF Llama 256x4 at 25% and 384 tokens, it
    moved 0.5 MB, predicted 0.21-0.24 s and ran 0.21-0.25 s. Counted as moving, it was no
    fallback, and a size whose first plan kept every block and moved 26 MB stayed there, at
    0.30-0.35 s a step, in one run of three: nothing ran the mix that was faster."""
    moved = predicted.moved_bytes
    return ("selective" not in modes and moved <= unavoidable
            and moved <= LIGHT_SHARE * predicted.total_seconds * bytes_per_s)


def calibrations(ran: Iterable[tuple[bool, float]]) -> tuple[float, float]:
    """(quiet, moving): the factors a quiet and a moving mix that did not run are read at, from
    ``(moving, measured / predicted)`` of each mix that ran."""
    ran = list(ran)
    if len(ran) < MIN_CALIBRATION_RUNS:
        return 1.0, 1.0
    lo, hi = CALIBRATION_CLAMP
    quiet = min(hi, max(lo, min(r for _, r in ran)))
    moving = [r for m, r in ran if m]
    return quiet, min(hi, max(lo, min(moving))) if moving else quiet      # (>= quiet)


COST_RANK = {"keep": 0, "selective": 1, "full": 2}   # a block's compute, least first


def level(a, pa, b, pb) -> bool:
    """Whether quiet mix ``a`` (its swap plan's prediction ``pa``), fitting its budget with no
    forced copies, is predicted no slower than quiet mix ``b`` (``pb``): two quiet mixes differ
    by the compute they repeat, which the model reads off the same blocks' times, so a measured
    time that puts ``a`` behind is noise. The mode search's climb (``modes._ModeSearch.climb``)
    finds mixes that recompute as many blocks as another, elsewhere: on a hand-built 4-block
    view, two kept and two full at 1.4x their prediction (one noisy step) left for another two
    kept and two full that had not run, predicted the same."""
    return (not moving(a, pa) and not moving(b, pb) and pa.budget_ok and not pa.forced_offloads
            and pa.total_seconds <= pb.total_seconds * (1 + 1e-9))


def dominates(a, pa, b, pb) -> bool:
    """Whether mix ``a`` (its swap plan's prediction ``pa``) does no more work than ``b`` (``pb``)
    in every respect the model is sure of: a quiet mix (``moving``: it keeps and fully
    recomputes blocks and copies nothing), each block kept where ``b`` keeps or recomputes it,
    fitting its budget with no forced copies and no more stall predicted. Such a mix cannot run
    slower but by noise: on the CPU demo (HF Llama 128x8 at 25%, a busy 2-core machine) a size
    that ran one block kept and seven full, nothing moved, was moved to all eight full by one
    step that read 123 ms where its others read 89, and all full then ran 1.01-1.35x of
    checkpointing's step."""
    return (a != b and all(COST_RANK[x] <= COST_RANK[y] for x, y in zip(a, b))
            and not moving(a, pa) and pa.budget_ok and not pa.forced_offloads
            and pa.stall_seconds <= pb.stall_seconds)

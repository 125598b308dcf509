"""Plans as the runtime keeps them: a timeline plan compiled into per-span decisions and copy-back
triggers (``compile_plan``; a mix's, made on its timeline before it ran: ``compile_mix``), and a
bounded LRU of them by operator-sequence signature (``PlanCache``). Data only:
``policy/chameleon.py`` applies them.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from .signatures import KeyIndex, TensorKey
from .timeline import unmoved_peak

DEFAULT_PLAN_CACHE_SIZE = 16


@dataclass
class PlanEntry:
    """A plan compiled for the runtime: decisions and fetch triggers per span (record)."""

    signature: str
    ids: list[int]
    keys: list[TensorKey]
    n_forward: int
    move: list[bool]
    triggers: dict[int, list[int]]      # span k first used -> issue copies back of these spans
    at_forward_end: list[int]           # copies back issued when forward ends
    predicted_stall_seconds: float
    predicted_peak_bytes: int
    detailed: bool                      # made from a timed profile (else from estimates)
    nbytes: list[int] = field(default_factory=list)   # per span, as profiled
    moved_bytes: int = 0                # bytes the plan moves out
    budget_bytes: int = 0               # the budget it was made for
    made_at: int = 0
    last_used: int = 0
    predicted_step_seconds: float = 0.0  # the whole step as the timeline model predicted it
    replanned: bool = False             # made again after its predictions missed the steps
    modes: Optional[dict] = None        # with model=: block -> mode the profiled step ran
    by_mix: bool = False                # a mix's, made before it ran (``compile_mix``): uncached
    peak_bytes: int = 0                 # its unmoved peak where held bytes add to the spans'
    size: Optional[int] = None          # with model=: the step size it was made at (step_size)
    checked: bool = True                # steps are checked against its prediction (not where
                                        # it was made from a step the planner process slowed)
    _index: Optional[KeyIndex] = field(default=None, repr=False)
    _sums: Optional[tuple] = field(default=None, repr=False)

    @property
    def index(self) -> KeyIndex:
        if self._index is None:
            self._index = KeyIndex(self.keys)
        return self._index

    @property
    def span_sums(self) -> tuple:
        """(its spans' bytes, the bytes of the spans it marks to move), summed once: a plan
        followed by keys asks at every save (``policy.swap_jobs``). A mix's ``moved_bytes``
        also counts spans left to the guard, which it does not mark."""
        if self._sums is None:
            self._sums = (sum(self.nbytes), sum(n for n, m in zip(self.nbytes, self.move) if m))
        return self._sums


class PlanCache:
    """Bounded LRU of compiled plans by signature."""

    def __init__(self, capacity: int = DEFAULT_PLAN_CACHE_SIZE) -> None:
        self.capacity = capacity
        self._entries: "OrderedDict[str, PlanEntry]" = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, sig: str) -> bool:
        return sig in self._entries

    def get(self, sig: str) -> Optional[PlanEntry]:
        e = self._entries.get(sig)
        if e is None:
            self.misses += 1
        else:
            self.hits += 1
            self._entries.move_to_end(sig)
        return e

    def peek(self, sig: str) -> Optional[PlanEntry]:
        """The entry of ``sig`` (None: none), neither counted nor made recent."""
        return self._entries.get(sig)

    def put(self, entry: PlanEntry) -> None:
        self._entries[entry.signature] = entry
        self._entries.move_to_end(entry.signature)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def entries(self) -> list[PlanEntry]:
        """Most recently used first."""
        return list(reversed(self._entries.values()))


def compile_plan(profile, tl_plan, step: int) -> PlanEntry:
    """Turn a timeline Plan (slots) into runtime triggers (first uses of spans)."""
    n = profile.n_forward
    by_use_slot = {u: i for i, u in enumerate(profile.use_slot) if u < profile.n_slots}
    move = [False] * n
    triggers: dict[int, list[int]] = {}
    at_end: list[int] = []
    # Issue copies back in the order they will be needed.
    for j in sorted(tl_plan.move, key=lambda j: (tl_plan.fetch_at.get(j, n), profile.use_slot[j])):
        move[j] = True
        slot = tl_plan.fetch_at.get(j, n)
        if slot <= n:
            at_end.append(j)
        else:
            k = by_use_slot.get(slot)
            if k is None:               # the slot of a span never used: fall back to its own use
                k = j if profile.use_slot[j] < profile.n_slots else None
            if k is not None:
                triggers.setdefault(k, []).append(j)
    pred = tl_plan.predicted
    return PlanEntry(signature=profile.signature, ids=list(profile.ids), keys=list(profile.keys),
                     n_forward=n, move=move, triggers=triggers, at_forward_end=at_end,
                     predicted_stall_seconds=float(pred.stall_seconds) if pred else 0.0,
                     predicted_peak_bytes=int(pred.peak_bytes) if pred else 0,
                     predicted_step_seconds=float(pred.total_seconds) if pred else 0.0,
                     nbytes=list(profile.nbytes),
                     moved_bytes=sum(profile.nbytes[j] for j in tl_plan.move),
                     budget_bytes=tl_plan.budget or 0,
                     detailed=profile.detailed, made_at=step, last_used=step)


def compile_mix(profile, swap, origins, keys, signature: str, step: int,
                size: Optional[int] = None) -> PlanEntry:
    """The swap plan ``swap`` of a mix, made on its timeline ``profile`` (``HybridPlan``),
    compiled as a plan applied by tensor keys: the span that is the keep view's span
    ``origins[j]`` gets that span's key (``keys``); the input span of a recomputed block
    (``origins[j] < 0``) a key no tensor has, so its tensors are the guard's. Its copies back are
    issued at the first use of the latest span the runtime can find that backward needs at or
    before their slot (at forward's end where none is)."""
    n, n_slots = len(profile.spans), len(profile.compute)
    span_keys = [keys[o] if 0 <= o < len(keys) else TensorKey(-2, 0, j, "", ())
                 for j, o in enumerate(origins)]
    by_use: dict[int, int] = {}
    for j, sp in enumerate(profile.spans):
        if origins[j] >= 0 and sp.use < n_slots:
            by_use.setdefault(sp.use, j)
    uses = sorted(by_use)
    move = [False] * n
    triggers: dict[int, list[int]] = {}
    at_end: list[int] = []
    for j in sorted(swap.move, key=lambda j: (swap.fetch_at.get(j, 0), profile.spans[j].use)):
        if origins[j] < 0:
            continue                         # (the guard's: see above)
        move[j] = True
        i = bisect_right(uses, swap.fetch_at.get(j, 0)) - 1
        if i < 0:
            at_end.append(j)
        else:
            triggers.setdefault(by_use[uses[i]], []).append(j)
    nbytes = [sp.nbytes for sp in profile.spans]
    return PlanEntry(signature=signature, ids=[], keys=span_keys, n_forward=n, move=move,
                     triggers=triggers, at_forward_end=at_end, predicted_stall_seconds=0.0,
                     predicted_peak_bytes=0, detailed=False, nbytes=nbytes,
                     moved_bytes=sum(nbytes[j] for j in swap.move), budget_bytes=swap.budget or 0,
                     made_at=step, last_used=step, by_mix=True, peak_bytes=unmoved_peak(profile),
                     size=size)

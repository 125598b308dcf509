"""Activation budgets from a cap on all device memory (``Chameleon(device_memory_limit=...)``).

Pure arithmetic on byte counts the engine measures; no torch, so it is tested on any machine.

A step's device peak is what was allocated when it began, plus the saved activations the engine
keeps resident (at most the budget), plus everything else the step allocates: logits and their
gradients, attention workspaces, weight gradients, tensors in flight between ops. That last part,
the *transient*, is not fixed: the logits of a 12k-token step are half again those of an 8k step.
So it is learnt per step *size*, where a step's size is the bytes it saves for backward (it grows
with tokens, and with the attention scores where those are saved, as the transient does):

* each finished step adds an observation (size, transient); a prediction for size ``s`` is the
  chord between the nearest observed sizes around ``s`` (an upper bound for any transient that is
  linear or convex in the size), the transient of the smallest step seen for smaller steps, and
  the largest step's transient scaled by ``s / size`` for larger ones (an upper bound when the
  transient is a fixed part plus a part proportional to the size); never less than a transient
  seen at a size no larger than ``s``.
* at step start the size is not known: the previous step's is assumed. As forward runs, the bytes
  saved so far are compared with what the previous step had saved after the same number of module
  calls; the ratio extrapolates this step's size, and when that is larger than assumed the budget
  is lowered mid-step (the guard then copies out more), long before the logits are allocated. The
  budget never rises again within a step: a step smaller than assumed keeps the assumed reserve.
* on top of the prediction: a relative margin (``margin``), a fixed one (``min_margin_bytes``) and
  the caching allocator's fragmentation seen in recent steps (free bytes inside segments that also
  hold live blocks: the allocator cannot hand them back when it runs short, unlike whole free
  segments it releases before failing).
* a miss (measured transient above the prediction or above the room the budget left, or a step
  that ran out of memory) multiplies the safety factor applied to every later prediction, and the
  report says so. ``relax_after`` finished steps in a row without a miss divide it back by as
  much (never below ``1 + margin``): a miss says what one step needed, not every later step.
  Without that the factor only grew, and every later budget shrank with it: on an H100 (HF
  Llama 4096x8 under a 31 GiB cap, lengths 4k-16k, the mix of kept, swapped and recomputed
  blocks changing between steps) the second pass of a 7-step schedule ran with budgets of
  2.2-5.5 GiB where the first had run 8.8-17.7 GiB, moving 10-30 GiB a step at 2.5-3.4 s
  against 0.5 s plain (how much of that was the factor and how much the fragmentation kept
  free was not recorded; the report now carries both).
"""
from __future__ import annotations

import bisect
import dataclasses
from collections import deque
from typing import Optional

MIB = 2**20


@dataclasses.dataclass
class MemoryReport:
    """What the budget derivation did for one step (fields of ``StepStats``)."""

    min_budget_bytes: int                      # lowest budget in force during the step
    predicted_transient_bytes: Optional[int]   # prediction at the size the step turned out to
                                               # have, safety factor included (None: first step)
    transient_bytes: int                       # measured: device peak above the step's start,
                                               # less the most saved-activation bytes resident
    tightened: bool                            # a miss: later steps leave more room
    safety: float = 1.0                        # the safety factor after the step
    fragmentation_bytes: int = 0               # kept free for fragmentation from then on


class DeviceMemoryBudget:
    """Derive each step's activation budget from ``limit_bytes``, a cap on all device memory.

    The engine calls ``begin_step`` when a step starts, ``on_progress`` on each module call in
    forward (a new budget or None), and ``end_step`` with what the device measured.

    Args:
        limit_bytes: the cap on all memory allocated on the device.
        margin: the relative safety factor on every predicted transient (0.10: 10% more).
        min_margin_bytes: bytes kept free besides the prediction (allocator rounding, jitter).
        window: observations kept (the most recent ones), so a workload that changes is not
            judged by its distant past forever.
        miss_growth: what the safety factor is multiplied by after each miss (at most
            ``max_safety``).
        first_share: the share of the free memory the first step may keep activations in, with
            nothing learnt yet (the rest is left for its logits, gradients and workspaces).
        relax_after: finished steps in a row without a miss after which the safety factor is
            divided by ``miss_growth`` (not below ``1 + margin``).
    """

    def __init__(self, limit_bytes: int, *, margin: float = 0.10, min_margin_bytes: int = 64 * MIB,
                 window: int = 32, miss_growth: float = 1.25, max_safety: float = 4.0,
                 first_share: float = 0.25, relax_after: int = 8) -> None:
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 0:
            raise ValueError(f"limit_bytes must be an int >= 0; got {limit_bytes!r}")
        if not margin >= 0:
            raise ValueError(f"margin must be a number >= 0; got {margin!r}")
        if not miss_growth > 1:
            raise ValueError(f"miss_growth must be a number > 1; got {miss_growth!r}")
        if not 0 <= first_share <= 1:
            raise ValueError(f"first_share must be a number in [0, 1]; got {first_share!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1; got {window!r}")
        if not max_safety >= 1 + margin:
            raise ValueError(f"max_safety must be a number >= 1 + margin; got {max_safety!r}")
        if isinstance(relax_after, bool) or not isinstance(relax_after, int) or relax_after < 1:
            raise ValueError(f"relax_after must be an int >= 1; got {relax_after!r}")
        self.relax_after = relax_after
        self._clean = 0                     # finished steps in a row without a miss
        self.first_share = first_share
        self.limit_bytes = limit_bytes
        self.min_margin_bytes = min_margin_bytes
        self.miss_growth = miss_growth
        self.max_safety = max_safety
        self.safety = self._base_safety = 1.0 + margin
        self._obs: deque[tuple[int, int]] = deque(maxlen=window)     # (size, transient)
        self._gaps: deque[int] = deque(maxlen=window)
        self._last_size: Optional[int] = None
        self._ref: Optional[tuple[list[int], int]] = None     # previous step: prefix, total
        # This step.
        self._headroom = 0
        self._user_budget: Optional[int] = None
        self._size = 0
        self._budget = 0
        self._min_budget = 0
        self._prefix: list[int] = []

    # ------------------------------------------------------------------ prediction
    def predict_transient(self, size: int) -> Optional[int]:
        """Non-activation bytes of a step that saves ``size`` bytes, safety factor included;
        None before the first observation."""
        if not self._obs:
            return None
        best: dict[int, int] = {}
        floor = 0            # steps that saved nothing (forward only) bound every size from below
        for s, t in self._obs:
            if s > 0:
                best[s] = max(t, best.get(s, 0))
            else:
                floor = max(floor, t)
        sizes = sorted(best)
        i = bisect.bisect_right(sizes, size)          # sizes[:i] <= size < sizes[i:]
        floor = max([floor] + [best[s] for s in sizes[:i]])
        if not sizes:
            est = floor
        elif i == len(sizes):                         # as large as the largest seen, or larger
            top = sizes[-1]
            est = best[top] * size / top
        elif i == 0:                                  # smaller than any seen
            est = best[sizes[0]]
        else:
            lo, hi = sizes[i - 1], sizes[i]
            est = best[lo] + (best[hi] - best[lo]) * (size - lo) / (hi - lo)
        return int(max(floor, est) * self.safety)

    def reserve_for(self, size: int) -> int:
        """Bytes kept free besides the activation budget for a step of ``size``."""
        transient = self.predict_transient(size)
        if transient is None:
            # Nothing learnt yet. A step's transient can be several times its activations' share
            # of the free memory (a large vocabulary's logits and their gradients), so the
            # blind first step keeps activations in a quarter of it by default (less after a
            # step that ran out of memory before anything was learnt).
            share = self.first_share * self._base_safety / self.safety
            return self._headroom - int(self._headroom * share)
        return transient + self.fragmentation_kept + self.min_margin_bytes

    @property
    def fragmentation_kept(self) -> int:
        """Bytes kept free for fragmentation: the most seen in the window's steps."""
        return max(self._gaps, default=0)

    def _budget_for(self, size: int) -> int:
        derived = max(0, self._headroom - self.reserve_for(size))
        return derived if self._user_budget is None else min(self._user_budget, derived)

    # ------------------------------------------------------------------ one step
    def begin_step(self, allocated_bytes: int, user_budget: Optional[int] = None) -> int:
        """The budget a step starts with, ``allocated_bytes`` being allocated when it begins;
        never above ``user_budget`` (the engine's ``budget``) when there is one."""
        self._headroom = max(0, self.limit_bytes - allocated_bytes)
        self._user_budget = user_budget
        self._size = self._last_size or 0
        self._prefix = []
        self._budget = self._min_budget = self._budget_for(self._size)
        return self._budget

    def on_progress(self, saved_bytes: int) -> Optional[int]:
        """A module is about to run in forward, ``saved_bytes`` having been saved so far this
        step: the lowered budget when the step turns out larger than assumed, else None.

        ``saved_bytes`` counts what the step's recomputed blocks so far did not save (beside
        their inputs), as its size at ``end_step`` does: read against a previous step's, saves
        alone were another measure. On an H100 (HF Llama 4096x8 under a 31 GiB cap) a kept step
        after one whose blocks recomputed read as several times its size, and its budget was
        lowered to 0: it moved all it saved (8k tokens: 19.7 GB, 1.6 s where the plain step
        took 0.23 s)."""
        k = len(self._prefix)
        self._prefix.append(saved_bytes)
        size = max(self._size, saved_bytes)
        if self._ref is not None and saved_bytes > 0:
            prefix, total = self._ref
            # Only a prefix that holds a fair share of the previous step says much about scale.
            if k < len(prefix) and prefix[k] * 64 >= total > 0:
                size = max(size, saved_bytes * total // prefix[k])
        if size <= self._size:
            return None
        self._size = size
        budget = self._budget_for(size)
        if budget >= self._budget:
            return None
        self._budget = budget
        self._min_budget = min(self._min_budget, budget)
        return budget

    def end_step(self, *, saved_bytes: int, peak_allocated: int, allocated_at_start: int,
                 peak_resident: int, fragmentation_bytes: int = 0, failed: bool = False,
                 out_of_memory: bool = False, recomputed_bytes: int = 0) -> MemoryReport:
        """Learn from a finished step: ``peak_allocated`` is the device's peak during it,
        ``peak_resident`` the most saved-activation bytes the engine held, and
        ``fragmentation_bytes`` the most free bytes stuck inside partly used allocator segments.
        A ``failed`` step teaches nothing (it may have stopped before backward) unless it ran
        ``out_of_memory``: a miss, whose transient (cut short by the failure) is not kept as an
        observation, but whose size so far is assumed for the next step.

        ``recomputed_bytes``: what the step's recomputed blocks did not save (they re-created
        it in backward, held as resident then). The step's size is what it saved and that, so a
        size does not depend on the mix the step ran: on an H100 (HF Llama 4096x8 under a 31 GiB
        cap) a 16k-token step of selective blocks saved 5 GiB where kept ones saved 30, its
        transient was theirs (7.7 GiB against 6.6-7.6), and counted at the small size it was a
        miss (1.6 GiB predicted) that then bounded every larger size from below: a 4k-token
        step, whose transient is 0.9 GiB, kept 13.2 GiB free for it."""
        transient = max(0, peak_allocated - allocated_at_start - peak_resident)
        size = max(saved_bytes + max(0, recomputed_bytes), self._size if out_of_memory else 0)
        predicted = self.predict_transient(size)
        # A miss: more transient than predicted for the step's size, or more than the budget in
        # force left room for (the size was underestimated and nothing lowered the budget).
        over = transient > (predicted if predicted is not None else transient) \
            or self._budget + transient > self._headroom
        tightened = out_of_memory or (not failed and over)
        if tightened:
            self.safety = min(self.max_safety, self.safety * self.miss_growth)
            self._clean = 0
        elif not failed:
            self._clean += 1
            if self._clean >= self.relax_after:
                self.safety = max(self._base_safety, self.safety / self.miss_growth)
                self._clean = 0
        if out_of_memory or not failed:
            self._gaps.append(max(0, fragmentation_bytes))
            if size > 0:
                self._last_size = size
        if not failed:
            self._obs.append((size, transient))
            if saved_bytes > 0:     # (what this step saved by each call, scaled to its size)
                self._ref = (self._prefix, size)
        self._prefix = []
        return MemoryReport(min_budget_bytes=self._min_budget, predicted_transient_bytes=predicted,
                            transient_bytes=transient, tightened=tightened,
                            safety=self.safety, fragmentation_bytes=self.fragmentation_kept)

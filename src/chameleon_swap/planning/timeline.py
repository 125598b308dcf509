"""The cost model of one step: a compute stream, one D2H and one H2D copy stream, a memory curve.

Standard library only (no torch, no numpy needed): the planner evaluates hundreds of candidate
plans with it and the simulator reuses it. It mirrors what the runtime (executor + planned policy)
does with a plan. This module holds the data and ``simulate``'s entry; the simulation's pieces
(forward phase, backward phase, copy streams, pending copies) are in ``timeline_run``.

Slots. A step is a sequence of slots on the compute stream: ``n_forward`` forward slots (forward
slot ``i`` ends with the saves of the spans whose ``save == i``), then backward slots. A span's
``use`` is the slot at whose *start* backward first needs it; ``use == n_slots`` means never again.

Memory. A span counts from its save to the end of its use slot (to the end of the step when never
used). A moved span counts from its save until its copy-out completes, and again from when its
copy back is issued until the end of its use slot. Since every save happens in forward and every
use in backward, the unmoved peak is the sum of all span sizes.

Reserve. ``Profile.reserve`` gives bytes held during each slot that are not spans and never move:
the outputs selective checkpointing keeps (from the block's forward to its recompute) and the
activations a recomputed block re-creates for its backward. They count towards the peak and the
budget; spans get what the reserve leaves (``budget - reserve[slot]``), and copies back are issued
only into room that no later slot's reserve needs (the runtime keeps room for the recomputes to
come). A backward slot whose reserve finds too little room waits for the copies out in flight,
oldest first, as the guard does (``make_room_backward``): that wait is stall. Where even that
leaves too little (the guard would copy out spans not used yet), it goes over the budget.

Copies. D2H is one FIFO stream: a moved span's copy-out is enqueued at its save and takes
``nbytes / d2h``. H2D is one FIFO stream: copies back are issued at the start of slot ``fetch_at``
(clamped to ``[n_forward, use]``; missing means ``use``) and take ``nbytes / h2d`` each.
At one slot start the pending copies back are tried in order of (fetch slot, use, index), which is
the order in which the runtime issues them.

Decisions that mirror the runtime (the executor and ``policy/chameleon.py``):

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

``swap_only_bound_seconds = max(sum(compute), F / d2h, F / h2d)`` where ``F`` is the number of
bytes copied back to the device in the prediction (each of those was copied out before and both
copies end before some slot of the step starts, on one stream each). ``total_seconds`` is never
below it. It bounds swapping only: a plan that recomputes trades copies for compute and escapes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import Mapping, Optional

from .timeline_run import CopiesBack, Run, backward, forward


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
    # Host time each moved span costs the compute stream (issuing its copies, keeping its books):
    # half in its save slot, half in its use slot. 0: moves are free of compute.
    move_seconds: float = 0.0

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

    def charged(self, move) -> "Profile":
        """This profile with ``move_seconds`` of compute added for each span in ``move`` (half
        at its save, half at its use; all at its save if it is never used)."""
        c = list(self.compute)
        half = self.move_seconds / 2
        for j in move:
            sp = self.spans[j]
            c[sp.save] += half
            c[sp.use if sp.use < len(c) else sp.save] += half
        return Profile(tuple(c), self.n_forward, self.spans, self.d2h_bytes_per_s,
                       self.h2d_bytes_per_s, self.reserve)

    @cached_property
    def starts(self) -> tuple:
        """Start time of every slot with no stall, and the end of the step (n_slots + 1)."""
        return (0.0, *accumulate(float(c) for c in self.compute))

    @cached_property
    def _reserves(self) -> tuple:
        """The reserve per slot (zeros where there is none), and from each slot on the largest
        reserve still to come: copies back are issued only into room that no later reserve needs
        (the runtime keeps room for the recomputes still to come). Once per profile, not once
        per simulation (a mode plan simulates one view 10-50 times)."""
        reserve = self.reserve or (0,) * self.n_slots
        ahead = list(reserve)
        for s in range(len(ahead) - 2, -1, -1):
            if ahead[s + 1] > ahead[s]:
                ahead[s] = ahead[s + 1]
        return reserve, tuple(ahead)

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
    total_seconds: float          # sum(compute) + stall (+ move_seconds per forced copy)
    swap_only_bound_seconds: float    # max(sum(compute), F / d2h, F / h2d), F = bytes copied back
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


def unmoved_peak(profile: Profile) -> int:
    """Peak with every span resident from its save to the end of its use slot: every save comes
    before every release, so it is the sum of all span sizes (plus the reserve, where a profile
    has one: then the peak is found by simulating the plan that moves nothing)."""
    if any(profile.reserve):
        return simulate(profile, Plan(frozenset()), None).peak_bytes
    return sum(sp.nbytes for sp in profile.spans)


def swap_only_bound(profile: Profile, fetched_bytes: int) -> float:
    """No schedule that copies ``fetched_bytes`` out and back again ends sooner than this."""
    return max(float(sum(profile.compute)), fetched_bytes / profile.d2h_bytes_per_s,
               fetched_bytes / profile.h2d_bytes_per_s)


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
    each_move = profile.move_seconds
    if each_move and plan.move:
        profile = profile.charged(plan.move)
    run = Run(profile, plan, budget, curve, trace is not None)
    forward(run)
    back = CopiesBack(run)            # after forward: its forced copies out are copied back too
    backward(run, back)
    if trace is not None:
        out_done, move, fslot = run.out_done, run.move, run.fslot
        trace.update(use_stall=run.use_stall, save_stall=run.save_stall, forced=run.forced,
                     out_done={j: out_done[j] for j in range(len(move)) if move[j] or j in fslot},
                     slot_start=run.slot_start, deferred=back.deferred)
    # A forced copy costs the host what a planned move does (the executor moves it the same
    # way): without this, a plan that leaves the guard to force copies would look cheaper than
    # one that plans them. Charged to the total (after the run: where in the step it falls
    # changes nothing the prediction reports).
    forced_cost = each_move * run.forced_n
    return Prediction(peak_bytes=run.peak, stall_seconds=run.stall,
                      total_seconds=float(sum(profile.compute)) + run.stall + forced_cost,
                      swap_only_bound_seconds=swap_only_bound(profile, run.fetched),
                      budget_ok=budget is None or run.peak <= budget,
                      forward_stall_seconds=run.fstall, moved_bytes=run.moved,
                      fetched_bytes=run.fetched, forced_offloads=run.forced_n,
                      sync_fetches=back.sync_n, overflow_bytes=back.overflow)


def memory_curve(profile: Profile, plan: Plan, budget: Optional[int]) -> list:
    """``(time, resident bytes)`` points of ``plan`` (a step function: each point holds until the
    next), starting at ``(0, 0)``; for plots."""
    pts: list = [(0.0, 0)]
    simulate(profile, plan, budget, curve=pts)
    return pts

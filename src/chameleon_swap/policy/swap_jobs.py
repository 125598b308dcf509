"""Swap plans made in the planner process once making them on the step's thread costs; and what
a policy follows a plan by tensor keys with (which plan, how much it moves, its top-up) and makes
a plan of its own after (``adapt``).

A swap plan (``planning/swaps.py``: which saved tensors move and when each comes back) is made at
the end of a step whose operator sequence has no plan yet, on the step's thread, and the step's
wall time pays for it. Measured on this project's 2-core CPU, the hybrid benchmark's Llama (78
spans at 384 tokens, a mix that swaps): 40-80 ms of wall time beyond a 260-410 ms step at each
new mix, about 130 timeline simulations a plan; on an H100 the demo's once took 113 ms.

With a planner process (``background.Worker``: with ``model=`` and ``plan_in_background``, where
mode plans are made), once a plan made here took longer than ``BACKGROUND_SECONDS``, or longer
than ``BACKGROUND_SHARE`` of the step that asked for it (and over ``BACKGROUND_MIN_SECONDS``),
the next ones are handed to the process, plans made again after a step missed its prediction
(``checks._remake_swap_plan``) among them. The share: on the CPU demo's Llama a plan took 11-21
ms at the end of steps of 60-160 ms, under the absolute threshold, so every new sequence's step
and every replanned one paid 10-20% of itself on the step's thread (about 3% of the run). The
step that asked ends at once; its sequence runs as any sequence without a plan does (a plan that
agrees by keys, or the guard) until the plan lands, at the end of a later step, where it is
compiled against the profile it was made from and cached (unless a newer plan for the sequence
is there by then). Plans under that cost stay on the
step's thread: a small model's plan takes a millisecond or two, less than a job's round trip,
and lands for the very next step. A job that fails is not retried; the sequence is planned
again here when it next wants a plan.
"""
from __future__ import annotations

import time
from typing import Optional

from ..planning.cache import PlanEntry, compile_mix, compile_plan
from ..planning.signatures import step_size
from ..runtime.records import RESIDENT
from . import checks

BACKGROUND_SECONDS = 0.02   # a plan made here that took longer sends the next ones to the process
BACKGROUND_SHARE = 0.05     # ... as does one that took more than this share of its step
BACKGROUND_MIN_SECONDS = 0.005   # and longer than this (a job's round trip is a few ms)
MAX_PENDING = 8             # plans in the process at once; more are made here (a new sequence
                            # every step, faster than the process plans, must not pile up)
BEHIND_STEPS = 2            # a job unanswered for more steps than this: the process is behind
                            # (a starved or loaded machine), and plans are made here meanwhile
RECENT_STEPS = 4            # an estimated plan used this recently earns a detailed step (adapt)
TOP_UP_FROM = 0.2           # share of a plan by keys' bytes matched before it is topped up


def entry_of(profile, tl_plan, step: int, slowed: bool) -> PlanEntry:
    """The cache entry of swap plan ``tl_plan``, made from ``profile`` at step ``step``.
    ``slowed``: the step is exempt for what slowed it (``PlanChecks.exempt``); its plan is made
    again from the next detailed step. Where the host arena's pinning slowed it, its figures
    are 10-20x off and the plan predicts nothing (``checks.pinned``). Where the planner process
    did, the plan keeps its prediction, reported where no mode plan's stands for the step
    (every plan a step applies carries one: a 4-block Llama at 25% on 50 MB/s, with the
    process busy through most of its second step, reported none on its third), but no step is
    checked against it (``checked``): it reads high, and faster is a miss too."""
    entry = compile_plan(profile, tl_plan, step)
    if slowed:
        entry.detailed = False
        if checks.pinned(profile):
            entry.predicted_step_seconds = 0.0
        else:
            entry.checked = False
    if profile.blocks:
        entry.modes = {}
        for c in profile.blocks:
            entry.modes.setdefault(c.block, c.mode)
        entry.size = step_size(profile.blocks[0].input_bytes)
    return entry


def mode_entry(plan, step: int) -> Optional[PlanEntry]:
    """Mode plan ``plan``'s swap set (``mix_runs.ModePlan``: the search's, on its mix's timeline)
    as a plan by keys (``compile_mix``), made once per hybrid plan; None where it moves nothing or
    its keep view's keys are unknown. A step in a mix that no step of its own planned yet runs
    on it instead of the guard alone (the emulated-link benchmark at 25%, 384 tokens: a mix that
    keeps blocks stalled 87-150 ms on such steps, 0-34 ms once its own plan was there)."""
    hp = plan.hybrid
    if plan.entry is None or plan.entry[0] is not hp:
        # (Made for this hybrid plan: a mode plan copied with another mix, a fallback on trial,
        # carries the entry of the plan it was copied from.)
        usable = (plan.keys and hp.swap.move and len(hp.origins) == len(hp.profile.spans))
        entry = (compile_mix(hp.profile, hp.swap, hp.origins, plan.keys,
                             f"mix:{plan.key}:{','.join(hp.modes)}", step, plan.key)
                 if usable else None)
        if entry is not None:
            entry.modes = dict(plan.modes)
        plan.entry = (hp, entry)
    return plan.entry[1]


def plan_in_modes(policy) -> Optional[PlanEntry]:
    """The plan by keys for a step of ``policy`` whose modes no cached plan's events agree with:
    a cached plan made in its block modes at its size, else its mode plan's swap set
    (``mode_entry``), else a cached plan in its modes made at another size (None: the guard).
    The mode plan's is made for the step's size; another size's plan moves in proportion
    (``wants_more``), but what it predicts is another step's."""
    m = policy.modes
    agree = [e for e in policy.cache.entries() if policy._modes_agree(e)]
    return (next((e for e in agree if e.size == m.key), None)
            or mode_entry(m.plan, policy.step_no) or next(iter(agree), None))


def wants_more(plan: PlanEntry, step_bytes: int, plan_bytes: int, moved: int,
               budget: int) -> bool:
    """Whether a plan by keys (made for another sequence, or a mix's before it ran) that says
    "move this one" is worth following: only while the step has moved (``moved``) less than it
    must. Its tensors so far (``step_bytes``), against the plan's for the same spans
    (``plan_bytes``), scale the plan's natural peak to the step's; what must go is that minus
    the budget, with the plan's own margin (moved over needed) on top. A plan for long sequences
    applied to a short one moves nothing when the short step fits; the guard still holds the
    budget if the estimate was low. A mix's peak is more than its spans' bytes: its recomputes
    hold their working sets (``PlanEntry.peak_bytes``)."""
    if plan_bytes <= 0:
        return True
    return moved < scaled_need(plan, step_bytes, plan_bytes, budget)


def scaled_need(plan: PlanEntry, step_bytes: int, plan_bytes: int, budget: int) -> float:
    """What a step followed by a plan by keys must move in all (``wants_more``): the plan's
    peak scaled by the step's bytes of the spans matched so far over the plan's, minus the
    budget, times the plan's own margin."""
    peak = plan.peak_bytes or plan.span_sums[0]
    need = peak * step_bytes / plan_bytes - budget
    plan_need = peak - plan.budget_bytes
    if plan_need > 0:
        need *= max(1.0, plan.moved_bytes / plan_need)
    return need


def top_up(policy, plan: PlanEntry) -> None:
    """``policy`` (a ``ChameleonPolicy``) following ``plan`` by keys on a step larger than the
    plan's own (its matched spans' bytes against the plan's): what the plan's moves still to come
    will not cover goes now, from the records it keeps, saved first (needed last) first, while
    their copies can overlap the forward. Left to the budget's edge, the guard moved them there and the step waited
    for the link: measured on this project's 2-core CPU (the emulated-link benchmark's HF
    Llama 256x8 at 50%, 384 tokens), a mix's first step on its plan by keys moved 14.1 MiB
    on the plan's word where the step saved 5 MiB more than the plan's spans, and the guard
    moved the rest with 12 budget waits and 8 fetches on demand: 20.8 ms of stall."""
    total, planned = plan.span_sums
    if policy._plan_bytes < TOP_UP_FROM * total or not policy._kept:
        return
    ex = policy.ex
    need = scaled_need(plan, policy._step_bytes, policy._plan_bytes, ex.budget)
    to_come = (planned - policy._planned_seen) * policy._step_bytes / policy._plan_bytes
    short = need - policy._fuzzy_moved - to_come
    while short > 0 and policy._kept:
        old = policy._kept.popleft()
        if old.state == RESIDENT and old.counted and old.handles:
            ex.offload(old)              # (or put off until a host buffer is ready)
            policy.guard._inflight.append(old)
            policy._fuzzy_moved += old.nbytes
            policy._topped_up += 1
            short -= old.nbytes


def adapt(policy, profile) -> None:
    """After a step followed by a plan by keys, or by none: whether its sequence gets a plan of its
    own (made here or by the planner process), and whether the next step is timed."""
    entry = policy.cache.get(profile.signature)
    miss = policy._miss()
    if entry is None and not miss and policy._fits(profile) and not policy._applied.by_mix:
        # A sequence new in detail, but the plan applied to it (by keys) held without the
        # guard's help: like the paper, keep it instead of planning again (MoE routing makes
        # a new signature nearly every step; planning each costs more than it saves). Not
        # a mix's plan made before it ran (``by_mix``): the mix's own steps are planned.
        return
    if entry is None or (profile.detailed and (not entry.detailed or miss)):
        made = policy.swap_jobs.make(policy, profile)       # (None: the planner process's)
        if made is not None:
            policy.cache.put(made)
    # Detail is wanted when a plan was missed, or a plan still made from estimates has
    # been in use lately (a recurring sequence gets timed once, then runs from cache).
    recent = [e for e in policy.cache.entries() if policy.step_no - e.last_used < RECENT_STEPS]
    policy._want_detail = (miss and not profile.detailed) or any(not e.detailed for e in recent)


class SwapJobs:
    """The swap plans a policy has handed to the planner process, by signature."""

    def __init__(self) -> None:
        # signature -> (ticket, profile, step, slowed, again): ``again`` is None for a first
        # plan, else the ``detailed`` of the plan it is made again for (``make``)
        self.pending: dict[str, tuple] = {}
        self.slow = False                       # the last plan made here took too long
        self.seconds = 0.0                      # the process's time on the plans landed

    def make(self, policy, profile, again: Optional[bool] = None) -> Optional[PlanEntry]:
        """``profile``'s plan made now, or None where the planner process makes it. ``again``:
        the plan is made again for a plan of this sequence that missed (``detailed`` its own
        flag): it replaces one still in the process, and is marked replanned (``_again``)."""
        worker = policy.modes.worker
        # (read before a job made again replaces the job of its sequence)
        behind = bool(self.pending) and self.behind(policy.step_no)
        job = self.pending.get(profile.signature)
        if job is not None:
            if again is None:
                return None                     # (being made there already)
            worker.drop(job[0])                 # made from an older step: this one's instead
            del self.pending[profile.signature]
        if (self.slow and worker is not None and worker.broken is None
                and len(self.pending) < MAX_PENDING and not behind):
            ticket = worker.submit("plan_swaps", policy.timeline(profile), policy.ex.budget)
            if ticket is not None:
                self.pending[profile.signature] = (ticket, profile, policy.step_no,
                                                   policy.pinned_step, again)
                return None
        t0 = time.perf_counter()
        entry = policy._make(profile)
        took = time.perf_counter() - t0
        step = getattr(profile, "step_seconds", None)     # (None: not known, the cap alone)
        self.slow = took > (min(BACKGROUND_SECONDS, max(BACKGROUND_MIN_SECONDS,
                                                       BACKGROUND_SHARE * step))
                            if step else BACKGROUND_SECONDS)
        return entry if again is None else _again(entry, again)

    def behind(self, step: int) -> bool:
        """A job handed over more than ``BEHIND_STEPS`` steps before ``step`` is unanswered: a
        plan handed over now might not land for as long (a replan that never landed left a
        plan missing its steps by 3x for 16 steps, where one made here corrected it)."""
        return any(step - job[2] > BEHIND_STEPS for job in self.pending.values())

    def land(self, policy) -> None:
        """Cache the plans the process has made (called at a step's end, before it plans)."""
        worker = policy.modes.worker        # (none: nothing was ever handed over)
        for sig, (ticket, profile, step, slowed, again) in list(self.pending.items()):
            if not worker.ready(ticket):
                continue
            del self.pending[sig]
            seconds, ok, tl_plan = worker.result(ticket)
            if not ok:
                continue
            policy.modes.landed_seconds += seconds      # reported as the process's planning
            self.seconds += seconds
            newer = policy.cache.peek(sig)
            if newer is None or newer.made_at <= step:
                entry = entry_of(profile, tl_plan, step, slowed)
                policy.cache.put(entry if again is None else _again(entry, again))


def _again(entry: PlanEntry, detailed: bool) -> PlanEntry:
    """A plan made again after its sequence's plan missed: reported as replanned. A lightweight
    step's compute is a timed step's shares of the same sequence scaled to the measured step
    (profiler): as good as the timed profile it corrects, so no timed step is asked for again."""
    entry.replanned = True
    entry.detailed = entry.detailed or detailed
    return entry

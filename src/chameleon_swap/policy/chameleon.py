"""Apply a swap plan, adapt it to changing operator sequences, and fall back to the guard.

``ChameleonPolicy`` (``policy="chameleon"``) is the paper's loop: every step is profiled cheaply;
at its end the step's signature is looked up in a bounded LRU ``PlanCache``; a signature with no
plan gets one from the planner (from estimated slot times at once, refined by a detailed, timed
step when it comes back); a signature seen before goes straight to its cached plan.

Within a step the plan is found while the step runs, since its signature is known only at the end:
every cached plan whose event sequence agrees with the events so far stays a candidate, and the
most recently used one is applied, tensor by tensor, by save position. When no candidate agrees
any more, tensors are matched by ``TensorKey`` (module, call and saved ordinal, dtype, shape with
varying dimensions tolerated; never by address) to the closest plan's entries, a plan made in the
step's block modes (with ``model=``: a cached one, else the mode plan's swap set).

Whatever matches nothing goes to the guard, and the guard holds the budget whatever the plan says:
a stale plan costs speed, never the budget (LESSONS 6). A plan by keys is scaled to the step: it
moves on its word only while the step still has to (``swap_jobs.wants_more``), and where the step
turns out larger than the plan's own spans, what its moves will not cover goes early, from the
records it keeps (``swap_jobs.top_up``), rather than at the budget's edge.

``StaticPolicy`` (``policy="static"``, ``static.py``) is the warm-up-frozen peers' baseline: the
same planner, run once on the first step after warm-up, then applied by save position forever.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Optional

from ..runtime.executor import HOST, OFFLOADING, RESIDENT, Executor, Record
from .guard import GuardPolicy
from .block_modes import COLD_STEPS, BlockModes
from .host_room import HostRoom
from .checks import PlanChecks, check_step
from ..planning.cache import DEFAULT_PLAN_CACHE_SIZE, PlanCache, PlanEntry
from .swap_jobs import SwapJobs, adapt, entry_of, plan_in_modes, top_up, wants_more
from .lean import end_lean, learn_step

FIT_COVERAGE = 0.9        # share of saved bytes a plan must match to be kept for a new sequence


class ChameleonPolicy:
    name = "chameleon"
    adaptive = True
    recomputes = True         # with a model, blocks run keep / selective / full per its plans

    def __init__(self, ex: Executor, cache_size: int = DEFAULT_PLAN_CACHE_SIZE) -> None:
        self.ex = ex
        self.guard = GuardPolicy(ex)
        self.cache = PlanCache(cache_size)
        self.bandwidth_fn = None            # () -> (d2h, h2d) bytes/s, set by the engine
        # Block modes (keep / selective / full) when the engine was given a model.
        self.checks = PlanChecks()          # every plan checked against the step it ran
        self.modes = BlockModes(lambda: self.link(), self.checks.move_seconds)
        pool = getattr(ex, "pool", None)
        self.modes.host_limit = getattr(pool, "limit_bytes", None)
        self.host_room = HostRoom(ex)       # blocks run full when the host arena is short
        self.step_no = 0
        self._want_detail = True            # the very first step is timed
        self._prev_sig: Optional[str] = None
        self.planner_seconds = 0.0
        self.swap_jobs = SwapJobs()         # swap plans the planner process is making
        self._reset_step()

    # ------------------------------------------------------------------ step boundaries
    def _reset_step(self) -> None:
        self._alive: list[PlanEntry] = []   # plans whose events agree with this step's so far
        self._checked = 0                   # events compared against the alive plans
        self._active: Optional[PlanEntry] = None
        self._fuzzy: Optional[PlanEntry] = None
        self._span_of: dict[int, int] = {}  # record index -> span of the applied plan
        self._rec_of: dict[int, Record] = {}  # span -> record
        self._taken: set[int] = set()       # spans matched in fuzzy mode
        self._kept: deque[Record] = deque()   # records the plan keeps resident (earliest first)
        self._pending: list[int] = []       # spans whose copy back found no room yet
        self._applied: Optional[PlanEntry] = None
        self._ended_forward = self._fuzzy_used = self.pinned_step = False   # (the last: exempt)
        self._plan_bytes = 0                # matched spans: their bytes in the plan ...
        self._step_bytes = 0                # ... and this step's bytes of the same tensors
        self._fuzzy_moved = 0               # bytes moved on a fuzzily matched plan's word
        self._planned_seen = 0              # of its spans matched so far, the bytes it moves
        self._topped_up = 0                 # records it kept, moved early (``top_up``)
        self.overrides = 0                  # planned-resident records the guard had to move
        self._agree: dict[int, bool] = {}   # id(plan) -> its block modes are this step's
        self._no_plan_in_modes = False      # _in_modes found none (the modes hold all step)

    def wants_detail(self) -> bool:
        # Timings serve the planner only, which never runs without a budget: with none, every
        # step is lightweight. Block modes planned from the first step's figures alone want
        # the next steps timed too, until one corrects them (``BlockModes.warm``; a few), and
        # with no keep view yet every step with model= is (it may keep every block: host_room).
        cold = (not self.modes.warm and sum(self.modes.visits.values()) < COLD_STEPS
                if self.modes.views else bool(self.modes.eligible))
        return (self._want_detail or cold) and self.ex.budget is not None

    def begin_step(self) -> None:
        self.guard.begin_step()
        self._reset_step()
        self.modes.begin_step(self.ex.budget)
        self._alive = self.cache.entries()
        self._fuzzy = self._alive[0] if self._alive else None
        self._active = self._alive[0] if self._alive else None

    # ------------------------------------------------------------------ which plan
    def _follow(self) -> None:
        """Keep the plans whose event ids agree with this step's events so far."""
        ids = self.ex.profiler.ids
        n = len(ids)
        if self._checked == n or not self._alive:
            self._checked = n
            return
        lo = self._checked
        alive = [e for e in self._alive if len(e.ids) >= n and e.ids[lo:n] == ids[lo:n]]
        self._checked = n
        if alive:
            if alive[0] is not self._active:
                self._active = alive[0]
                self._span_of = {i: i for i in self._span_of}   # spans are save positions
                self._rec_of = {r.index: r for r in self._rec_of.values()}
        elif self._active is not None:
            # No plan agrees any more: match the rest by key against the one that agreed longest.
            self._fuzzy = self._active
            self._taken = set(self._span_of.values())
            self._fuzzy_used = bool(self._span_of)
            self._active = None
        self._alive = alive

    def _span_for(self, rec: Record) -> Optional[int]:
        self._follow()
        if self._active is not None:
            if self._modes_agree(self._active):
                self._applied = self._active
                return rec.index if rec.index < self._active.n_forward else None
            self._active, self._alive = None, []    # of other modes: by keys from here on
        plan = self._fuzzy
        if plan is None or not self._modes_agree(plan):
            plan = self._in_modes()
        if plan is None or rec.key is None:
            return None
        span = plan.index.find(rec.key)
        if span is None or span in self._taken:
            return None
        self._taken.add(span)
        self._applied = plan
        self._fuzzy_used = True
        return span

    def _in_modes(self) -> Optional[PlanEntry]:
        """For a step whose plan by keys is of other block modes: one of its modes
        (``swap_jobs.plan_in_modes``), by keys from then on (records matched so far: guard's)."""
        m = self.modes
        if m.key is None or m.plan is None or m.upsized or self._no_plan_in_modes:
            return None
        plan = plan_in_modes(self)
        self._no_plan_in_modes = plan is None
        if plan is not None:
            self._fuzzy, self._taken, self._span_of, self._rec_of = plan, set(), {}, {}
            self._plan_bytes = self._step_bytes = 0
        return plan

    def _modes_agree(self, plan: PlanEntry) -> bool:
        """A swap plan profiled in other block modes than this step's does not stand for its
        tensors (a recomputed block saves others, and frees room the plan did not know of):
        matched by key, it would move what this step's mode plan keeps. Asked at every save:
        answered once per plan a step, as soon as the step's mode plan is known."""
        now = self.modes.plan.modes if self.modes.key is not None and self.modes.plan else None
        if now is None or plan.modes is None:
            return True
        agree = self._agree.get(id(plan))
        if agree is None:
            agree = all(now.get(b, m) == m for b, m in plan.modes.items())
            self._agree[id(plan)] = agree
        return agree

    def _plan(self) -> Optional[PlanEntry]:
        return self._active if self._active is not None else (self._fuzzy if self._fuzzy_used else None)

    # ------------------------------------------------------------------ forward
    def make_room(self, rec: Record) -> None:
        ex = self.ex
        g = self.guard
        # The guard underneath keeps room for one more tensor of the largest size seen, for the
        # records no plan covers: it must see every save, not only those that find no room.
        g._largest = max(g._largest, rec.nbytes)
        target = ex.budget - rec.nbytes
        if ex.resident_bytes <= target:
            return
        g._offload_down_to(target, include_small=True)       # unplanned records first
        staying = ex.resident_bytes - ex.inflight_out_bytes
        while staying > target and self._kept:
            old = self._kept.popleft()
            if old.state == RESIDENT and old.counted:
                self.overrides += 1
                ex.offload(old)
                g._inflight.append(old)
                staying -= old.nbytes
        while ex.resident_bytes > target and g._inflight:
            old = g._inflight.popleft()
            if old.state != HOST and old.out_ticket is not None and not old.out_ticket.done():
                ex.wait_offload(old)
            else:
                ex.copy.poll()

    def after_save(self, rec: Record) -> None:
        if self.ex.budget is None:
            return
        span = self._span_for(rec)
        plan = self._plan()
        if span is None or plan is None:
            self.guard.after_save(rec)
            return
        self._span_of[rec.index] = span
        self._rec_of[span] = rec
        if span < len(plan.nbytes):
            self._plan_bytes += plan.nbytes[span]
            self._step_bytes += rec.nbytes
            if plan.move[span]:
                self._planned_seen += plan.nbytes[span]
        if plan.move[span] and (self._active is not None or wants_more(
                plan, self._step_bytes, self._plan_bytes, self._fuzzy_moved, self.ex.budget)):
            if rec.state == RESIDENT and rec.counted:
                self.ex.offload(rec)
                self.guard._inflight.append(rec)
                if self._active is None:
                    self._fuzzy_moved += rec.nbytes
        else:
            self._kept.append(rec)
        if self._active is None:
            top_up(self, plan)
        elif rec.index == plan.n_forward - 1:
            self._forward_end()

    # ------------------------------------------------------------------ backward
    def _forward_end(self) -> None:
        if self._ended_forward:
            return
        self._ended_forward = True
        plan = self._plan()
        if plan is not None:
            self._issue(plan.at_forward_end)

    def _issue(self, spans: list[int]) -> None:
        ex = self.ex
        pending = self._pending + list(spans)
        self._pending = []
        room = ex.budget - ex.resident_bytes - ex.recompute_reserve
        for j in pending:
            rec = self._rec_of.get(j)
            if rec is None or rec.used or rec.failed:
                continue                          # unmatched (the guard's) or needed already
            if rec.state == OFFLOADING:
                self._pending.append(j)           # still on its way out: retry later
                continue
            if rec.state != HOST:
                continue                          # on the device already, or released
            if rec.nbytes > room:
                self._pending.append(j)
                continue
            ex.prefetch(rec)
            room -= rec.nbytes

    def on_first_use(self, rec: Record) -> None:
        if self.ex.budget is None:
            return
        self._forward_end()
        plan = self._plan()
        span = self._span_of.get(rec.index)
        if plan is not None and span is not None:
            self._issue(plan.triggers.get(span, []))
        elif self._pending:
            self._issue([])

    def on_unpack(self, rec: Record) -> None:
        self.guard.on_unpack(rec)

    def on_backward_trigger(self) -> None:
        if self.ex.budget is None:
            return
        self._forward_end()
        if self._pending:
            self._issue([])
        self.guard.on_backward_trigger()

    def make_room_backward(self, rec: Record) -> bool:
        return self.guard.make_room_backward(rec)

    # ------------------------------------------------------------------ step end: adapt
    def report(self) -> dict:       # what the engine puts into StepStats for this step
        return self._report

    def link(self) -> tuple[float, float]:
        """(d2h, h2d) bytes/s the planner uses: as corrected from steps, else ``bandwidth_fn``'s."""
        return self.checks.link or self.bandwidth_fn()

    def end_step(self, profile=None) -> None:
        if self.modes.lean:
            return end_lean(self, profile)      # nothing on it was planned (lean.py)
        self.pinned_step = profile is not None and self.checks.exempt(profile, self.modes.key)
        self.guard.end_step()
        self.host_room.end_step(profile)
        applied, source, predicted, predicted_stall = self._applied, "guard", None, None
        if applied is not None:
            if applied.replanned:
                source, applied.replanned = "replanned", False
            elif profile is not None and applied.signature == profile.signature and not self._fuzzy_used:
                source = "planned" if applied.signature == self._prev_sig else "cache"
            else:
                source = "planned"
            applied.last_used = self.step_no
            predicted = applied.predicted_step_seconds or None
            predicted_stall = applied.predicted_stall_seconds
        mode_plan = self.modes.plan if self.modes.key is not None else None
        if mode_plan is not None:
            # With model= the step ran a mode plan: its source and prediction are the step's,
            # unless a checked swap plan made in these modes stood for it (it models its copies:
            # a 4-block Llama at 25%, 50 MB/s: 110 ms predicted for steps of 117-141 ms, the mode
            # plan's 74 ms); its source only where replanned. (A ``by_mix`` plan predicts none.)
            swap_stands = (applied is not None and applied.predicted_step_seconds and applied.modes
                           and applied.size == self.modes.key    # (another's predicts another)
                           and applied.checked and self._modes_agree(applied)
                           and self._fits(profile))
            mode_source = self.modes.source()
            source = source if swap_stands and source == "replanned" else mode_source or source
            if not swap_stands:
                predicted = self.modes.predicted_seconds()
                pred = mode_plan.hybrid.predicted
                predicted_stall = float(pred.stall_seconds) if pred is not None else None
        self._report = {"plan_source": source, "plan_overrides": self.overrides,
                        "predicted_stall_seconds": predicted_stall, "predicted_step_seconds":
                        predicted, "background_planning_seconds": self.modes.landed()}
        if profile is not None and self.ex.budget is not None:
            self.checks.learn_moves(profile)    # before any plan of this step's end is made
        if profile is not None and profile.n_forward > 0 and self.ex.budget is not None:
            self.swap_jobs.land(self)
            adapt(self, profile)
            self._prev_sig = profile.signature
        if profile is not None and profile.blocks:
            t0 = time.perf_counter()         # mode planning counts as planning time too
            self.modes.end_step(profile, profile.blocks, ok=True, pinned=self.pinned_step)
            self.planner_seconds += time.perf_counter() - t0
        learn_step(self, profile)               # a size the budget holds whole (lean.py)
        if profile is not None and self.ex.budget is not None:
            check_step(self, profile, applied, mode_plan, predicted)
        self.step_no += 1

    def block_mode(self, b: int, input_bytes: int) -> str:
        """The mode block ``b`` runs in now (asked by the recompute runner at its start).

        Room for a recompute is kept in backward, where it is needed: copies back leave room for
        every recompute to come (``recompute_reserve``); one that finds too little has the guard
        make it (``make_room_backward``). Forward keeps none (``b`` recomputes once all saved
        after its start is freed): kept there, a Llama's last, largest saves (logits, loss)
        waited to be copied out at forward's end, and an all-full mix cost what swapping did."""
        mode = self.modes.mode(b, input_bytes)
        room = self.host_room
        room.block_starts()
        if mode != "full" and room.short(b, input_bytes, self.modes):
            mode = self.modes.run_full(b, room.saved_bytes(input_bytes), input_bytes)
        room.started(mode, input_bytes)
        self.ex.recompute_reserve = self.modes.ahead()
        return mode

    def working_set(self, b: int) -> int:
        """Bytes to hold while block ``b``'s recompute and backward run (asked as it begins)."""
        ws = self.modes.working_set(b)
        self.ex.recompute_reserve = self.modes.ahead()
        return ws

    def _fits(self, profile) -> bool:
        """The applied plan stood for (nearly) all of this step's saved bytes."""
        if self._applied is None or profile is None:
            return False
        matched = sum(profile.nbytes[i] for i in self._span_of if i < len(profile.nbytes))
        return matched >= FIT_COVERAGE * sum(profile.nbytes)

    def _miss(self) -> bool:
        # (A plan by keys topped up did not stand for the step either: its moves fell short.)
        return self.overrides > 0 or self._topped_up > 0 or self.ex.stats.forced_offloads > 0

    def timeline(self, profile):
        """``profile`` on the timeline model, with the link and a move's cost as learnt."""
        return replace(profile.to_timeline(*self.link()), move_seconds=self.checks.move_seconds())

    def _make(self, profile) -> PlanEntry:
        from ..planning.swaps import plan as make_plan
        t0 = time.perf_counter()
        tl_plan = make_plan(self.timeline(profile), self.ex.budget)
        entry = entry_of(profile, tl_plan, self.step_no, self.pinned_step)
        self.planner_seconds += time.perf_counter() - t0
        return entry

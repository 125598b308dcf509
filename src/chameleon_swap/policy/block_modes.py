"""Block modes at run time: which mode each block runs in this step (policy side of recompute).

The recompute runner (``recompute/runner.py``, mechanism) asks ``mode(b, input_bytes)`` when block
``b`` starts; this class answers from a mode plan (``planning.modes.plan_hybrid``) made for the
step's size.

* Sizes. A step is keyed by its step size (``signatures.step_size``: its first block's input,
  tokens x hidden, bucketed). Each key gets a plan of its own; a step of a key not planned yet
  runs the plan of the nearest larger key (more recomputation is the safe side), else of the
  largest or every block full (``mix_runs.upsized``); its key is planned at the end of the step
  (``size_plans``: by default in the planner process, the plan landing at a later step's start).
* Keep views (``keep_views``): the step as it is with every block kept, measured on a detailed
  step that ran so (the very first step does), else the nearest one scaled to the size. Timed
  steps in other mixes correct the view its size plans from, and the size is planned again. A
  step slowed by the host arena's pinning or by the planner process on its cores
  (``checks.pinned``, ``checks.contended``) teaches nothing but a first view (``PlanChecks.exempt``:
  of a row of pinning steps the first, a size whose steps pin every visit pays it; of steps
  beside the planner, a size's first three).
  Planning again is rationed to ``PLANNING_SHARE`` of the steps' time (a thaw's plans are
  free), and a size whose replans keep choosing its mix waits 2, 4, 8... of its steps between
  them (``fruitless``): on the CPU demo each was 40-80 ms on 50-70 ms steps.
* What ran outranks what was predicted (``mix_runs``): mixes that ran are ranked by their step
  times, and a mix that copies, recomputes selectively or ran slower than predicted is checked
  once per size against its plan's fallback (kept and full blocks, next to nothing moved);
  faster stays. Not a mix that ran as predicted where its fallback is predicted clearly slower
  than it ran (``mix_runs.outran``), nor a quiet mix that keeps a block its fallback recomputes:
  only noise could favour that.
* Selective figures (what selective checkpointing keeps and costs) are measured, not assumed: the
  first time a plan recomputes a block fully and selective was never measured, one such block runs
  selective for one step; its held bytes and recompute time, against its keep-view figures, give
  the ratios used for every block of the model from then on, and every key is planned again.
* The first plans (from the first step's times, a warm-up), and a size's plans from a view
  scaled from another size's, run their fallback (``mix_runs.until_warm``) until a later step
  is timed (``keep_views.thaw``: every size planned again at once) or the size has its own view.
* The guard holds the budget underneath whatever the plan says: a plan made for another size
  costs speed, never the budget.
* Host room (``host_limit``: ``host_memory_limit``). Plans copy out at most what the host arena
  can hold (``plan_hybrid(host_limit=...)``), recomputing more instead; when no mix can, one
  warning says so. A block whose plan keeps it while the arena has no room left for what
  keeping it would move runs full instead (``run_full``, asked by the policy at its start).
"""
from __future__ import annotations

import statistics
from typing import Callable, Optional

from ..planning.modes import working_set
from ..planning.signatures import step_size
from . import keep_views
from .checks import MISS   # a mix that ran this much slower than planned: planned again
from .keep_views import KeepView
from .lean import LeanSizes
from .mix_runs import (TRIAL_STEPS, ModePlan, MixRuns, Trials, may_win, moved, outran,
                       reading, source, upsized)
from .size_plans import Job, SizePlans

REPLAN_BUDGET_CHANGE = 0.05     # a budget that moved by more than this re-plans the key
REPLAN_MOVE_CHANGE = 0.3       # so does a cost of a move that changed by more than this
PLANNING_SHARE = 0.05           # planning again takes at most this share of the steps' time
FIRST_PLANS_FALL_BACK = True    # plans from the first step's times run their fallback (size_plans)
COLD_STEPS = 4                  # ... at most this many steps (then warm, whatever was timed)
FULL_RATIOS_KEPT = 5            # steps whose full-recompute ratio the planner takes the median of


class BlockModes(SizePlans):
    def __init__(self, bandwidth_fn: Callable[[], tuple],
                 move_fn: Callable[[], float] = lambda: 0.0) -> None:
        self.bandwidth_fn = bandwidth_fn
        self.move_fn = move_fn              # () -> host seconds one moved span costs
        self.views: keep_views.Views = keep_views.Views()     # step size -> its keep view
        self.plans: dict[int, ModePlan] = {}
        self.sel_bytes_ratio: Optional[float] = None    # selective held / keep saved
        self.sel_seconds_ratio: Optional[float] = None  # selective recompute / keep forward
        self.full_seconds_ratio: Optional[float] = None  # full recompute / keep forward
        self._full_ratios: list[float] = []             # the last steps' (``_learn_full``)
        self._probe: Optional[int] = None               # block to run selective once
        self._probed = False
        self.eligible: list[bool] = []                  # per runner block (set by the engine)
        self.selective_safe: list = []                  # the runner's own list (see _sel_ok)
        self.visits: dict[int, int] = {}                # steps run per key
        self.compute_scale: dict[int, float] = {}       # per key: measured / predicted compute
        self.margin: dict[int, int] = {}                # per key: bytes the model missed
        self.warned_budgets: set = set()
        self.host_limit: Optional[int] = None           # host_memory_limit (set by the policy)
        self.warned_host = False
        self.stale: set = set()                         # keys to plan again (the link changed)
        self.runs = MixRuns()                           # per key: what each mix ran at
        self.planning_seconds = 0.0                     # spent making mode plans
        self.unrationed = 0.0                           # ... of which a thaw's (free)
        self.fruitless: dict = {}   # key -> (replans in a row that changed nothing, next visit)
        self.trained_seconds = 0.0                      # steps with a budget ran (see may_replan)
        self.put_off: set = set()                       # keys whose replan waits for its share
        self.trials = Trials()                          # per key: its fallback's trial
        self.timed: dict = {}                           # key -> timed steps' compute (keep_views)
        self.warm = not FIRST_PLANS_FALL_BACK          # compute timed past the first step
        self.jobs: dict[int, Job] = {}                  # key -> its plan being made (size_plans)
        self.landed_seconds = 0.0                       # ... the process's time, until reported
        self.lean_sizes = LeanSizes()                   # sizes the budget holds whole (lean.py)
        self.begin_step(None)

    # ------------------------------------------------------------------ during the step
    def begin_step(self, budget: Optional[int]) -> None:
        if self.jobs:
            self.collect()                  # plans the planner process has made: from now on
        self.budget = budget
        self.key: Optional[int] = None
        self.input_bytes = 0
        self.plan: Optional[ModePlan] = None
        self.upsized = False                # a size no plan fits (mix_runs.upsized)
        self.unready: Optional[bool] = None  # the plan's moves find no room ready (host_room)
        self.probing: Optional[int] = None
        self.pending: dict[int, int] = {}   # recomputes not begun: bytes beside their inputs
        self.forced: dict[int, int] = {}    # blocks run full for host room: their working sets
        self.lean = self.tripped = False    # the step runs lean (lean.py)
        self.lean_sizes.key = None

    def ahead(self) -> int:     # room copies back must leave: the largest recompute to come
        return max(self.pending.values(), default=0)

    def unsaved(self) -> int:   # in forward: what the recomputed blocks so far did not save,
        return sum(self.pending.values())       # beside their inputs (a step's size counts it)

    def mode(self, b: int, input_bytes: int) -> str:
        if self.budget is None:
            return "keep"
        if self.key is None:                 # the step's first block call: its size
            self.key, self.input_bytes = step_size(input_bytes), input_bytes
            self.plan = self._nearest(input_bytes)
            self.upsized = upsized(self.plan, self.key in self.plans, input_bytes, self.budget,
                                   self.bandwidth_fn()[0],
                                   self._view_near(input_bytes) if self.plan is None else None)
            self.lean_sizes.key = self.key
            self.lean = self.lean_sizes.wants(self.key, self.budget)
        if self.lean:
            return "keep"
        planned = ("full" if self.upsized else self.plan.modes.get(b, "keep")
                   if self.plan is not None else "keep")
        if planned == "keep":
            return "keep"                    # (the common case: no working set to look up)
        # The selective probe runs where the plan recomputes the block fully, never in place of
        # keeping it: a size the budget holds whole lost a step to a probe chosen by another's
        # plan (the emulated-link benchmark's 8-block Llama at 75%, 256 tokens, one block
        # selective on the second visit of a size where nothing moves or is recomputed).
        probe = self._probe is not None and b == self._probe and self.probing is None \
            and planned == "full"
        ws = self._working_set(b)
        rest = max(0, ws - input_bytes)      # what its recompute holds beside its inputs
        if probe:
            if ws + 3 * input_bytes <= self.budget:
                self.probing = b
                self.pending[b] = rest
                return "selective"
            # Selective keeps every matmul's output from forward, also those a kept block does
            # not save (projections back to the residual stream): it may not fit. Not probed.
            self._probe, self._probed = None, True
        if ws > self.budget:         # its recompute alone would not fit (a shorter size's
            return "keep"            # plan, or every block full): kept, its tensors can move
        self.pending[b] = rest
        return planned

    # ------------------------------------------------------------------ what the step ran on
    def predicted_seconds(self) -> Optional[float]:
        """The applied mode plan's step time, scaled to this step's size; None without one."""
        p = self.plan
        if p is None or self.key is None or self.upsized or self.unready:
            return None
        pred = p.hybrid.predicted
        if pred is None:
            return None
        return float(pred.total_seconds) * self.input_bytes / max(1, p.input_bytes)

    def source(self) -> Optional[str]:
        """plan_source of this step with ``model=`` (``mix_runs.source``)."""
        return source(self.plan, self.key, self.visits)

    def replan(self, key: int, compute_factor: float, missed_bytes: int = 0) -> None:
        """Correct the key's compute by ``compute_factor`` and its memory by ``missed_bytes``
        (what the guard moved beyond the plan), and plan it again when the ration allows
        (``may_replan``, ``fruitless``), else at a later step; while put off, the plan is the
        one the corrections were measured against, and it takes no more. Put off too while the
        key's plan is a fallback on trial (``mix_runs.Trials``): until its verdict."""
        if key in self.jobs or self.trials.running(key, self.plans.get(key)):
            self.stale.add(key)
            self.put_off.add(key)
            return
        if key not in self.put_off:
            self.compute_scale[key] = self.compute_scale.get(key, 1.0) * compute_factor
            if self.budget is not None and missed_bytes > 0:
                self.margin[key] = min(self.budget // 4, self.margin.get(key, 0) + missed_bytes)
        n, wait = self.fruitless.get(key, (0, 0))
        if not self.may_replan() or self.visits.get(key, 0) < wait:
            self.stale.add(key)
            self.put_off.add(key)
            return
        self.stale.discard(key)
        self.put_off.discard(key)
        self._make(key, after=(n, self.plans.get(key), self.visits.get(key, 0)))

    def may_replan(self) -> bool:
        """Planning again fits its share of the steps' time; first plans are made anyway, and
        charged (freed, the CPU demo ran 1.29-1.37x checkpointing's time, against 1.12-1.31x).
        A twentieth: first plans cheap (``planning/quiet.py``), a tenth left room for replans
        between mixes (demo: 1.25-1.35x checkpointing's time in three runs, 1.20-1.23x in two)."""
        return self.planning_seconds - self.unrationed <= PLANNING_SHARE * self.trained_seconds

    def run_full(self, b: int, estimate: int, input_bytes: int) -> str:
        """Block ``b`` runs full although its plan keeps it (no host room for what keeping it
        would move); ``estimate``: what it saves kept (its working set where no plan says)."""
        ws = max(self._working_set(b), estimate)
        self.forced[b] = ws
        self.pending[b] = max(0, ws - input_bytes)
        return "full"

    def working_set(self, b: int) -> int:
        """Bytes a recompute of block ``b`` re-creates, scaled to this step's size (asked when
        its recompute begins)."""
        self.pending.pop(b, None)
        forced = self.forced.pop(b, None)
        return forced if forced is not None else self._working_set(b)

    def _working_set(self, b: int) -> int:
        p = self.plan
        if p is None or not p.working_set.get(b):      # not recomputed in the plan (a probe)
            view = self._view_near(self.input_bytes)
            if view is None or b not in view.block_ids:
                return 0
            blk = view.blocks[view.block_ids.index(b)]
            ws = working_set(view.profile, blk)
            return int(ws * self.input_bytes / max(1, view.input_bytes))
        return int(p.working_set[b] * self.input_bytes / max(1, p.input_bytes))

    def _nearest(self, input_bytes: int) -> Optional[ModePlan]:
        plans, key = self.plans, step_size(input_bytes)
        if not plans or key in plans:
            return plans.get(key)
        larger = [p for p in plans.values() if p.input_bytes >= input_bytes]
        return (min(larger, key=lambda p: p.input_bytes) if larger
                else max(plans.values(), key=lambda p: p.input_bytes))

    def _view_near(self, input_bytes: int) -> Optional[KeepView]:
        key = self.views.near(input_bytes)
        return None if key is None else self.views[key]

    # ------------------------------------------------------------------ step end
    def end_step(self, profile, calls: list, ok: bool, pinned: bool) -> None:
        """Learn from the step: a keep view, selective figures; plan its key when needed.
        ``pinned``: the step is left out for its pinning or the planner beside it
        (``PlanChecks.exempt``)."""
        if not ok or self.budget is None or self.key is None or not calls:
            return
        self.visits[self.key] = self.visits.get(self.key, 0) + 1
        self.trained_seconds += profile.step_seconds or 0.0
        seen: set = set()                    # the first call of each block (one per step)
        calls = [c for c in calls if not (c.block in seen or seen.add(c.block))]
        kept = profile.detailed and all(c.mode == "keep" for c in calls)
        if not pinned:
            self._learn(profile, calls, kept)
        elif kept and not self.views:       # slow for its pinning: a first view, cold, at most
            self._learn_view(profile, calls, cold=True)
        self._warmed(sum(self.visits.values()) >= COLD_STEPS)  # no step could tell: as they are
        if self.key in self.jobs:
            return                              # its plan is being made: what it asks, then
        plan = self.plans.get(self.key)
        dearer = plan is not None and moved(plan.move_seconds, self.move_fn(), REPLAN_MOVE_CHANGE)
        if plan is not None and not plan.measured and self.key in self.views:
            self.stale.discard(self.key)        # its own keep view now: at once (once a size)
            self._make(self.key, free=True)
        elif self.key in self.stale or (dearer and plan.key == self.key) or self._moved_on(plan):
            # The link changed, or what a move costs did (learnt since), or the plan was made
            # from another size's keep view that changed since, or is no longer the nearest:
            # plan the key again.
            self.replan(self.key, 1.0)
        elif plan is None or moved(plan.budget, self.budget, REPLAN_BUDGET_CHANGE):
            self._make(self.key)

    def end_lean(self, seconds: Optional[float], moved: int) -> None:
        """A lean step ended (``lean.py``), having moved ``moved`` bytes after a trip."""
        if self.key is not None:                 # (with model=: a size of the mode plans)
            self.visits[self.key] = self.visits.get(self.key, 0) + 1
            self.trained_seconds += seconds or 0.0
        self.lean_sizes.ran(self.lean_sizes.key, seconds, moved, self.budget)

    def _moved_on(self, plan) -> bool:
        """``plan`` (this key's) was made from another size's keep view, and the view this key
        would plan from now is another, or that one changed since. (A key's own view changing
        has its own way back to planning, ``_learn``'s correction marking it stale; planning
        again at every change of it churned a test's mix away from the one that ran fastest.)"""
        if plan is None or plan.key != self.key or not plan.views_version:
            return False
        src = plan.views_version[0]
        return src != self.key and plan.views_version != self.view_stamp(self.key)

    def _learn(self, profile, calls: list, kept: bool) -> None:
        """What a step not slowed by pinning teaches: its mix's time, its view, the ratios."""
        self._learn_run(profile, calls)
        own = keep_views.own_forwards(profile, calls) if profile.detailed else {}
        if kept:
            self._learn_view(profile, calls)
            self._warmed(sum(self.visits.values()) > 1)
            self._thaw(self.warm and keep_views.timed_compute(profile, calls), own)
        elif profile.detailed:
            self._thaw(timed := keep_views.timed_compute(profile, calls), own)
            view = self.views.get(self.key) or self._view_near(self.input_bytes)
            now = timed and keep_views.settled(self.timed.setdefault(self.key, []), timed)
            better = view and now and keep_views.corrected(view, now, self.input_bytes,
                                                           self.key in self.views)
            self._warmed(bool(view and now))
            if better:
                self.views[self.key] = better
                self.compute_scale.pop(self.key, None)   # the view holds measured compute now
                if self.key in self.plans and self.plans[self.key].key == self.key:
                    self.stale.add(self.key)             # planned again below
        if self.probing is not None:
            self._learn_selective(calls, own)
        self._learn_full(calls, own)

    def _thaw(self, timed, own: dict) -> None:
        """First-step views corrected (``keep_views.thaw``), every size planned again, free."""
        if not (timed and keep_views.thaw(self.views, timed, self.input_bytes, own)):
            return
        here, self.warm = self.input_bytes, True
        sizes = {key: plan.input_bytes for key, plan in self.plans.items()}
        sizes.update((key, job.input_bytes) for key, job in self.jobs.items())  # (replaced)
        for key, size in sizes.items():
            self.input_bytes = size                     # (the size the key was planned at)
            self._make(key, free=True)
            self.stale.discard(key)
        self.input_bytes = here

    def _warmed(self, now: bool) -> None:
        """Compute timed past the first step (``now``), the first time: plan every size again
        (views still cold are taken as they are: no timed step could correct them)."""
        if now and not self.warm:
            self.warm = True
            self.stale.update(self.plans)
            self.views.warm()

    def _learn_run(self, profile, calls: list) -> None:
        """The step's time against the mix it ran (its blocks' modes as run: a probe, a block
        run full for host room or kept for its size make another mix; see ``mix_runs``)."""
        plan = self.plan
        if plan is None or plan.key != self.key or not profile.step_seconds or plan.stand_in:
            return              # (a stand-in runs in the first, slow steps: it ranks nothing)
        mix, seen, n = self.runs.add(self.key, calls, profile.step_seconds, self.budget)
        planned = tuple(sorted((b, plan.modes.get(b, "keep")) for b, _ in mix))
        if n < 2 or mix != planned or self.key in self.jobs:  # (a mix's first step ran on a
            return          # stand-in swap plan; a plan being made decides what runs next)
        if self.trials.running(self.key, plan):
            back = self.trials.back(self.key, n, seen)
            if back is not None:                    # not clearly faster: back, and the size
                self.plans[self.key] = back         # planned again on what both ran at
                self.stale.add(self.key)
            return
        # The faster of its last two steps, as trials and the ranking read steps (``mix_runs``;
        # by its low median of three a plan on its prediction was tried on noise more often).
        pred, ran = self.predicted_seconds() or float("inf"), reading(seen)
        # Tried against its fallback where it ran over its prediction, unless its model rules
        # the fallback out (``outran``); or where it copies over MISS of the step on the link or
        # runs selective (one probe), though it ran as predicted, if the fallback may win
        p, hp = plan.hybrid.predicted, plan.hybrid
        unsure = (p.moved_bytes / min(self.bandwidth_fn()) > MISS * p.total_seconds
                  or "selective" in hp.modes)
        want = ((ran > pred * (1 + MISS) and not outran(hp, pred, ran))
                or (unsure and may_win(hp, pred, ran)))
        if want and len(seen) < TRIAL_STEPS:
            return      # its trial waits for as many steps of its own as its fallback will run
        tried = want and self.trials.start(self.key, plan, ran)
        if tried:
            self.plans[self.key] = tried  # its fallback runs next (``mix_runs.Trials``)
        elif len(seen) == TRIAL_STEPS and ran > pred * (1 + MISS):   # (once a mix)
            self.stale.add(self.key)      # ranked now by what it ran at: planned again, once

    def measured(self, key: int, block_ids: list) -> dict:
        return self.runs.measured(key, block_ids)

    def _learn_view(self, profile, calls: list, cold: bool = False) -> None:
        d2h, h2d = self.bandwidth_fn()
        cold = cold or not self.warm and sum(self.visits.values()) <= 1   # the first step
        self.views[self.key] = keep_views.learn(profile, calls, d2h, h2d, self.eligible,
                                                self.input_bytes, cold, self.views.param_shapes)

    def _learn_full(self, calls: list, own: Optional[dict] = None) -> None:
        """``keep_views.full_ratio``, the median of the last ``FULL_RATIOS_KEPT`` steps', for
        later plans (no key planned again: that made a 12-step demo plan on most steps). The
        median: one step's spike (a recompute that a busy machine slowed) moves it not at all,
        where a running mean took half of it; a recompute slow on every step moves it in three."""
        r = keep_views.full_ratio(self._view_near(self.input_bytes), calls, self.input_bytes,
                                  own)
        if r:
            self._full_ratios = (self._full_ratios + [r])[-FULL_RATIOS_KEPT:]
            self.full_seconds_ratio = statistics.median(self._full_ratios)

    def _learn_selective(self, calls: list, own: dict) -> None:
        b, view = self.probing, self._view_near(self.input_bytes)
        self._probe, self._probed = None, True
        call = next((c for c in calls if c.block == b and c.mode == "selective"), None)
        if got := call and keep_views.selective_ratios(view, call, self.input_bytes, own):
            self.sel_bytes_ratio, self.sel_seconds_ratio = got
            self.stale.update(self.plans)       # every key planned again, selective known

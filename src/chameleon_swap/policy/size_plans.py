"""Making a step size's mode plan: its inputs, the plan (in-process or in the planner process),
and what it sets once made (``block_modes.BlockModes``' part that plans; a base class of it).

With a planner process (``worker``: ``background.Worker``, the engine's default) a plan is
handed over at the step's end (``_make``) and lands at a later step's start, once made
(``collect``): until then the size runs what it ran (its previous plan, or the nearest size's),
and the step's thread never waits for the search (on the project's CPU demo 40-145 ms a plan,
12-14% of the engine's time). Without one (``plan_in_background=False``, or where the process
cannot run) it is made at once, and used from the next step on. A size has at most one plan
being made: meanwhile its steps plan nothing, a replan asked of it is put off (``stale``) until
it lands, and only a thaw (``_thaw``), whose figures are newer, replaces it. A plan still
not made after ``DEADLINE_STEPS`` steps and ``DEADLINE_SECONDS`` (the process starved of a core
on a loaded machine) is made on the step's thread from the same inputs, and the process's answer
is dropped.

The time a plan takes (the search's own, in either process) is charged to the planning share
as before (``may_replan``), so the two ways plan alike; only where the time is spent differs.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, replace
from typing import Collection, Optional

from ..copy.host_pool import ALIGN
from ..planning.jobs import plan_size
from . import keep_views
from .keep_views import scaled
from .mix_runs import ModePlan, no_host_room, no_mix_fits, until_warm

# How long a plan may wait on the planner process: both, so that a tiny model's millisecond steps
# do not cut short a plan that is on time. On the project's CPU a plan lands within a step or two
# (3-95 ms a job; 64-block plans 0.7-1.0 s); a process starved of a core (10 steps nicer than its
# parent, with torch's threads busy) left a size on the nearest size's plan past the end of a
# 3-step test.
DEADLINE_STEPS = 6
DEADLINE_SECONDS = 2.0


@dataclass
class Job:
    """One size's plan being made: the search's inputs, and what its landing needs."""
    args: tuple                 # plan_size's arguments
    block_ids: list
    input_bytes: int
    budget: int
    measured: bool              # from the size's own keep view
    trusted: bool               # warm figures and own view (else it stands in: until_warm)
    move_seconds: float
    views_version: tuple        # ``view_stamp``: the keep view it is made from
    host: Optional[int]
    keys: tuple = ()            # the view's tensor keys (``KeepView.keys``)
    held: Collection = ()       # mixes that ran under this budget (``MixRuns.held``)
    seconds: float = 0.0        # spent on the step's thread preparing it
    free: bool = False          # a thaw's (not charged to the share)
    after: Optional[tuple] = None    # a replan's (repeats, old plan, visits) (``_replanned``)
    ticket: Optional[int] = None
    waited: int = 0             # steps begun while it was being made
    handed: float = 0.0         # when it went to the process (``time.perf_counter``)


class SizePlans:
    worker = None               # background.Worker, where plans are made in another process

    def collect(self, wait: bool = False) -> None:
        """Land the plans the planner process has made (``wait``: all of them, waiting), and
        make here those it has kept waiting ``DEADLINE_STEPS`` steps and ``DEADLINE_SECONDS``
        (called as a step begins)."""
        for key, job in list(self.jobs.items()):
            late = (not wait and job.waited >= DEADLINE_STEPS
                    and time.perf_counter() - job.handed >= DEADLINE_SECONDS)
            if not (wait or late or self.worker.ready(job.ticket)):
                job.waited += 1
                continue
            del self.jobs[key]
            if late and not self.worker.ready(job.ticket):
                self.worker.drop(job.ticket)
                seconds, ok = 0.0, False
            else:
                seconds, ok, hp = self.worker.result(job.ticket)
            if not ok:          # (the process failed or is late: this plan made here)
                t0 = time.perf_counter()
                hp = plan_size(*job.args)
                seconds = time.perf_counter() - t0
            else:
                self.landed_seconds += seconds
            self._charge(seconds + job.seconds, job.free)
            self._land(key, job, hp)
            if job.after is not None:
                self._replanned(key, *job.after)

    def view_stamp(self, key: int) -> tuple:
        """(the size whose keep view ``key`` plans from now, that view's stamp): its own where it
        has one, else the nearest to the current step's size (``()``: none). A plan made from
        another, or from this one before it changed, is out of date."""
        src = key if key in self.views else self.views.near(self.input_bytes)
        return () if src is None else (src, self.views.stamps.get(src, 0))

    def _make(self, key: int, free: bool = False, after: Optional[tuple] = None) -> None:
        """Plan ``key`` (``free``: not charged to the share; ``after``: a replan's, see
        ``_replanned``): handed to the planner process where one runs, else made now."""
        t0 = time.perf_counter()
        if self.worker is not None and self.worker.broken is None:
            job = self._job(key)
            if job is None:
                return
            ticket = self.worker.submit("plan_size", *job.args)
            if ticket is not None:
                old = self.jobs.pop(key, None)
                if old is not None:
                    self.worker.drop(old.ticket)
                job.ticket, job.free, job.after = ticket, free, after
                job.handed = time.perf_counter()
                job.seconds = job.handed - t0
                self.jobs[key] = job
                return
        try:
            self._plan_key(key)
        finally:
            self._charge(time.perf_counter() - t0, free)
        if after is not None:
            self._replanned(key, *after)

    def landed(self) -> float:
        """The planner process's time on the plans landed since last asked (the step's report:
        ``StepStats.background_planning_seconds``)."""
        seconds, self.landed_seconds = self.landed_seconds, 0.0
        return seconds

    def _charge(self, seconds: float, free: bool) -> None:
        self.planning_seconds += seconds
        self.unrationed += seconds if free else 0.0

    def _replanned(self, key: int, n: int, old, visits: int) -> None:
        """A replan of ``key`` landed: reported as such, and where it chose the mix ``old``
        had, the size waits 2, 4, 8... of its visits (from ``visits``) before the next."""
        if key in self.plans:
            self.plans[key].replanned = True
            n = n + 1 if old is not None and old.modes == self.plans[key].modes else 0
            self.fruitless[key] = (n, visits + (2 ** n if n else 0))

    def _plan_key(self, key: int) -> None:
        job = self._job(key)
        if job is not None:
            self._land(key, job, plan_size(*job.args))

    def _job(self, key: int) -> Optional[Job]:
        """What planning ``key`` takes, as the policy knows it now (None: no view to plan from)."""
        stamp = self.view_stamp(key)            # (the view it plans from: found once)
        if not stamp:
            return None
        view, measured = self.views[stamp[0]], stamp[0] == key
        if not measured:
            view = scaled(view, self.input_bytes / max(1, view.input_bytes), self.input_bytes)
        f = self.compute_scale.get(key, 1.0)
        if f != 1.0:
            view = scaled(view, 1.0, view.input_bytes, seconds=f)
        d2h, h2d = self.bandwidth_fn()
        prof = replace(view.profile, d2h_bytes_per_s=d2h, h2d_bytes_per_s=h2d,
                       move_seconds=self.move_fn())
        sel = self.sel_bytes_ratio, self.sel_seconds_ratio     # (none where it cannot run)
        blocks = [keep_views.with_ratios(prof, blk, *(sel if self._sel_ok(b) else (None, None)),
                                         self.full_seconds_ratio)
                  for b, blk in zip(view.block_ids, view.blocks)]
        # Host room: the limit less a page per span (every host buffer takes whole pages).
        host = (None if self.host_limit is None
                else max(0, self.host_limit - ALIGN * len(prof.spans)))
        old = self.plans.get(key)
        # The mix the size runs stays unless another is clearly faster; a stand-in never does.
        now = (tuple(old.modes.get(b, "keep") for b in view.block_ids)
               if old is not None and old.key == key and not old.stand_in else None)
        budget, trusted = self.budget - self.margin.get(key, 0), self.warm and measured
        held = self.runs.held(key, view.block_ids, self.budget)
        args = (prof, blocks, budget, host, now, self.measured(key, view.block_ids), not trusted,
                held)
        return Job(args, list(view.block_ids), view.input_bytes, self.budget, measured, trusted,
                   prof.move_seconds, stamp, host, view.keys, held=held)

    def _land(self, key: int, job: Job, hp) -> None:
        """Plan ``hp`` (``plan_size``'s, for ``job``) becomes ``key``'s."""
        hp = until_warm(hp, job.trusted)
        modes = dict(zip(job.block_ids, hp.modes))
        self.plans[key] = ModePlan(modes, dict(zip(job.block_ids, hp.working_set)),
                                   job.input_bytes, job.budget, job.measured, hp, key=key,
                                   move_seconds=job.move_seconds, stand_in=not job.trusted,
                                   views_version=job.views_version, keys=job.keys)
        pred = hp.predicted
        # A mix that ran under this budget fits it as it ran (``plan_hybrid``'s ``held``): the
        # search may choose it where the model reads it over, and that is no warning's case.
        fits = (pred.peak_bytes <= job.budget and not pred.forced_offloads) or hp.modes in job.held
        if not fits and job.budget not in self.warned_budgets:
            self.warned_budgets.add(job.budget)
            warnings.warn(no_mix_fits(job.budget, hp), RuntimeWarning, stacklevel=2)
        if job.host is not None and pred.moved_bytes > job.host and not self.warned_host:
            self.warned_host = True
            warnings.warn(no_host_room(self.host_limit, hp), RuntimeWarning, stacklevel=2)
        if not self._probed and self._probe is None and self.sel_bytes_ratio is None \
                and self.warm:                             # (not for a warm-up fallback's)
            # The last full block in forward order: its kept outputs are held the shortest
            # (its backward comes first), and then only as part of its working set.
            self._probe = max((b for b, m in modes.items() if m == "full" and self._sel_ok(b)),
                              default=None)

    def _sel_ok(self, b: int) -> bool:
        """Selective can run block ``b`` (``BlockRunner.selective_safe``; any, with no runner)."""
        s = self.selective_safe
        return not s or (b < len(s) and s[b] is True)

"""Every plan is checked against the step it ran: the closed loop around the planner.

A plan carries the step time its model predicted (``StepStats.predicted_step_seconds``). When a
key (a swap plan's signature, or a step size with ``model=``) runs more than ``MISS`` away from
its prediction on ``MISSES_TO_REPLAN`` steps in a row, the model is corrected from what those
steps measured and the key is planned again; the first step on the new plan reports
``plan_source == "replanned"``. The key's next ``COOLDOWN`` steps are not checked: on a loaded
machine, noise alone would otherwise keep re-planning (measured: 1-2 s per plan there). Slower than predicted is what costs users; faster is checked too,
since a model that overrates compute or underrates the link mis-chooses between swapping and
recomputing as surely.

What is corrected:

* the link: each direction's effective bandwidth, where the copy engine times its copies (the
  CPU's threads do: bytes over the seconds they spent copying); where it does not (CUDA), one
  factor on both directions, fitted so that the timeline model predicts the stall the step
  measured (bisection: the stall grows as the link slows);
* the compute: with ``model=``, on a step that moved tensors and ran slower than predicted, the
  excess is what each move costs the compute thread beyond what the profiler timed of it (see
  below), added to the timeline's ``move_seconds`` so that mixes that move more pay more; on a
  step that moved nothing, the key's keep view is scaled by measured over predicted compute
  (the step without its waits), which catches a size planned from another size's view.

What a move costs is not left to the misses alone. Where the profiler times the host's moves
apart from compute (the CPU: ``StepProfile.move_seconds_each``), every step that moved updates
the timed cost per moved span (a running mean), from the very first step: the first plan of
a model already knows that on a 2-core CPU each moved tensor costs the step about as much as a
small matmul (measured: 0.1-0.4 ms), which decides between swapping and recomputing there.
An earlier version also fitted the cost per move to what whole steps ran (each step's mix,
moves and measured compute, by least squares): on a 4-block HF Llama at a 25% budget it read
1.6-3.8 ms per move where the timing read 0.2-0.3 ms, because the gap it explained was the
runtime's own (copies the forward forced that no plan had, see ``ChameleonPolicy.block_mode``),
and together with the compute correction it made the plans flip between mixes. With that gap
gone the timed cost alone predicted the kept and the recomputed mixes within 3-7% there.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Hashable, Optional

from ..planning.timeline import simulate

MISS = 0.10                 # measured off predicted by more than this share is a miss
MIN_MISS_SECONDS = 0.005    # and by more than this: a few milliseconds of jitter on a tiny
                            # step is noise, not a model to correct (real steps take 0.1-1 s)
MISSES_TO_REPLAN = 2        # misses in a row (one key) before the model is corrected
MAX_MOVE_SECONDS = 0.01     # a learnt cost per moved span above this is not believed
COOLDOWN = 4                # steps of a key after a correction before it is checked again: a
                            # loaded machine's noise must not keep the planner busy
COMPUTE_CLAMP = (0.25, 4.0)  # a correction of compute by more than this is not believed
MIN_LINK_SECONDS = 1e-3     # copying time below which a direction's bandwidth is not measured
MOVE_MEAN_WEIGHT = 0.5      # weight of the newest step in the running mean of a move's cost
MOVES_FULL_WEIGHT = 16      # ... where it timed this many moves or more; fewer, in proportion
PLANNER_EXEMPT_STEPS = 3    # steps of one key left out for the planner process beside them
PLANNER_EXEMPT_KEYS = 1024  # keys whose such steps are counted (the oldest forgotten past it:
                            # without model= a run whose sequences stay new has a key a step)


class PlanChecks:
    """Misses per key, and the link as corrected from the steps (None: as configured)."""

    def __init__(self) -> None:
        self.misses: dict = {}
        self.factors: dict = {}     # per key: the compute correction each miss asked for
        self.cooldown: dict = {}
        self.link: Optional[tuple[float, float]] = None
        # Off when the user gave the planner a link (``link_bandwidth=``): a what-if plans for a
        # link the steps do not run on, so no step can confirm or refute it.
        self.enabled = True
        self.move_measured: Optional[float] = None   # host seconds per moved span, timed
        self.pinning: set = set()   # keys whose last step pinned (``exempt``)
        self.contended_steps: dict = {}   # per key: its steps left out for the planner

    def move_seconds(self) -> float:
        """Host seconds one moved span costs the step, for the timeline (``move_seconds``): the
        timed cost (a running mean over the steps that moved), at most ``MAX_MOVE_SECONDS``."""
        return min(MAX_MOVE_SECONDS, self.move_measured or 0.0)

    def learn_moves(self, profile) -> None:
        """Update the measured cost of a move from a step that moved (where it is timed)."""
        each = profile.move_seconds_each
        if each is None:
            return
        # A step that timed few moves (an all-full mix the guard helped with one small tensor)
        # says little: at full weight it moved the mean by a third and more, which planned the
        # size again (50-90 ms, on a 4-block Llama every few steps). It weighs in proportion.
        # (Weighed by its moves alone, the first step's many slow moves held the mean high for
        # good, and the emulated-link benchmark wandered between mixes at 50%.)
        old = self.move_measured
        w = MOVE_MEAN_WEIGHT * min(1.0, getattr(profile, "moved", MOVES_FULL_WEIGHT)
                                   / MOVES_FULL_WEIGHT)
        self.move_measured = each if old is None else old + w * (each - old)

    def observe(self, key: Hashable, predicted: Optional[float], measured: float,
                factor: float = 1.0) -> bool:
        """Record a step of ``key`` (``factor``: the compute correction it alone would ask
        for); True when it is time to correct the model (by ``agreed``) and plan again."""
        if not self.enabled or predicted is None or predicted <= 0:
            return False
        if self.cooldown.get(key, 0) > 0:
            self.cooldown[key] -= 1
            return False
        if abs(measured - predicted) > max(MISS * predicted, MIN_MISS_SECONDS):
            n = self.misses[key] = self.misses.get(key, 0) + 1
            self.factors.setdefault(key, []).append(factor)
            if n >= MISSES_TO_REPLAN:
                self.misses[key] = 0
                self.cooldown[key] = COOLDOWN
                return True
            return False
        self.forget(key)
        return False

    def exempt(self, profile, size: Optional[int] = None) -> bool:
        """Whether this step (of step size ``size`` with ``model=``, else of its signature) is
        neither checked nor learnt from for what slowed it.

        Its pinning (``pinned``): the first of a row of steps of its key that pinned. A key
        whose steps pin visit after visit pays that on every step: it is what its plan costs,
        and left out every time, the plan was never checked. On an H100 the capped schedule's
        selective steps each waited about 1 s for the host arena, and in the GPU demo (HF
        Llama 2048x16) a 6k-token mix of selective blocks ran 1.25-2.18 s for seven visits
        where 0.27 s was predicted and was never planned again (whether those steps pinned,
        that run did not record).

        The planner process on its cores: the key's first ``PLANNER_EXEMPT_STEPS`` such steps,
        in a row or not. The process works while sizes are new, beside their first visits in a
        row: on this project's 2-core CPU (HF Llama 256x8 at 25%, 130 MB/s) a size's second
        visit ran 0.54-0.80 s with the process busy for 0.24-0.42 s of it, where its later
        steps ran 0.25-0.42 s; learnt from, that one step ranked its mix the slowest for good
        (``mix_runs``: the 256-token size left five kept blocks, its fastest mix, in two
        benchmark runs). A run whose sequences stay new keeps the process busy for good: past
        the allowance its steps are what its plans cost, and are checked."""
        key = ("modes", size) if size is not None else profile.signature
        pins = pinned(profile)
        before = key in self.pinning
        if pins:
            self.pinning.add(key)      # (kept while pinning: as few as pinning steps)
        else:
            self.pinning.discard(key)
        if pins and not before:
            return True
        if contended(profile):
            n = self.contended_steps.get(key, 0)
            if n < PLANNER_EXEMPT_STEPS:
                if not n and len(self.contended_steps) >= PLANNER_EXEMPT_KEYS:
                    del self.contended_steps[next(iter(self.contended_steps))]
                self.contended_steps[key] = n + 1
                return True
        return False

    def forget(self, key: Hashable) -> None:
        """Misses of ``key`` counted so far no longer count."""
        self.misses.pop(key, None)
        self.factors.pop(key, None)

    def agreed(self, key: Hashable) -> float:
        """The compute correction the misses that called for it agree on: the one nearest 1
        where all ask the same way, else none (1). One step alone then never sets the model's
        compute: on this project's shared 2-core CPU a single step runs 10-30% off its
        neighbours and now and then twice as long (the demo: an all-full step at 0.197 s
        between steps of 0.096-0.098 s, nothing moved), and a correction from that step alone
        would double every block's compute for the size's next plan."""
        fs = self.factors.pop(key, None) or [1.0]
        if all(f >= 1.0 for f in fs):
            return min(fs)
        if all(f <= 1.0 for f in fs):
            return max(fs)
        return 1.0

    def correct_link(self, assumed: tuple[float, float], measured: dict,
                     stall_at: Optional[Callable[[float], float]] = None,
                     measured_stall: float = 0.0) -> tuple[float, float]:
        """The link from what the step measured: per direction from ``measured`` (``{"d2h":
        (bytes, seconds), ...}``, the copy engine's ``take_link()``), else one factor on
        ``assumed`` such that ``stall_at(factor)`` (the model's stall with the link scaled by
        factor) meets ``measured_stall``. Kept in ``self.link``."""
        out = list(assumed)
        timed = False
        for i, name in enumerate(("d2h", "h2d")):
            nbytes, seconds = measured.get(name, (0, 0.0))
            if nbytes > 0 and seconds > MIN_LINK_SECONDS:
                out[i] = nbytes / seconds
                timed = True
        # Where the copies are not timed (CUDA), one factor is fitted so that the model's stall
        # meets the measured one. Where they are, their speed stands: fitting the stall on top
        # was tried and misled (a plan that moves little barely depends on the link, so its
        # stall drove the fit to the floor, and the next plan was 5x slower).
        if not timed and stall_at is not None and measured_stall > stall_at(1.0):
            f = fit_factor(stall_at, measured_stall)
            out = [assumed[0] * f, assumed[1] * f]
        self.link = (float(out[0]), float(out[1]))
        return self.link


def contended(profile) -> bool:
    """The planner process had jobs beside the step, on a machine with no core to spare for it,
    for more than ``MISS`` of the step (``runtime.step_end.planner_busy_seconds``, in
    ``profile.extra``): its times are partly the planner's (``PlanChecks.exempt``)."""
    return _over_miss(profile, "planner_seconds")


def pinned(profile) -> bool:
    """The host arena allocated through more than ``MISS`` of the step (on CUDA: pinned;
    ``HostPool.allocating_seconds``, in ``profile.extra``). Such a step's times are the
    pinning's, not its plan's or its size's: on an H100 (HF Llama 4096x8) the first visit of a
    longer sequence pinned for 2-16 s of a 0.5 s step, its keep view then planned that size
    from figures 10-20x too slow, and the link fitted to its stall read up to 256 times too
    slow (a prediction of 90 s for a step of 0.6 s). Neither the step nor its keep view is
    checked or learnt from (``check_step``, ``BlockModes.end_step``); the next step is."""
    return _over_miss(profile, "host_alloc_seconds")


def _over_miss(profile, key: str) -> bool:
    """Seconds ``profile.extra[key]`` over ``MISS`` of the step's time (False where unknown)."""
    step = profile.step_seconds
    return bool(step) and profile.extra.get(key, 0.0) > MISS * step


def fit_factor(stall_at: Callable[[float], float], target: float, lo: float = 1 / 256,
               hi: float = 1.0, steps: int = 14) -> float:
    """The link factor in ``[lo, hi]`` whose predicted stall is closest to ``target`` from
    below (the stall falls as the factor grows)."""
    if stall_at(lo) <= target:
        return lo
    for _ in range(steps):
        mid = (lo * hi) ** 0.5           # geometric: bandwidths span orders of magnitude
        if stall_at(mid) > target:
            lo = mid
        else:
            hi = mid
    return hi


def compute_factor(measured_seconds: float, measured_stall: float, predicted_seconds: float,
                   predicted_stall: float) -> float:
    """Measured over predicted compute (each step without its waits), clamped."""
    pred = predicted_seconds - predicted_stall
    meas = measured_seconds - measured_stall
    if pred <= 0 or meas <= 0:
        return 1.0
    lo, hi = COMPUTE_CLAMP
    return min(hi, max(lo, meas / pred))


def stall_fn(tl_profile, plan, budget, scale: float):
    """``factor -> stall`` the timeline model predicts for ``plan`` with the link scaled by
    ``factor`` (and the step's times by ``scale``, for a plan made at another size)."""
    def stall_at(f: float) -> float:
        pr = replace(tl_profile, d2h_bytes_per_s=tl_profile.d2h_bytes_per_s * f,
                     h2d_bytes_per_s=tl_profile.h2d_bytes_per_s * f)
        return simulate(pr, plan, budget).stall_seconds * scale
    return stall_at


def check_step(policy, profile, applied, mode_plan, predicted) -> None:
    """At the end of a step of ``policy`` (a ``ChameleonPolicy``): compare the step with its
    prediction; after ``MISSES_TO_REPLAN`` misses of one key, correct the model (link, moves,
    compute, missed bytes) from this step and plan the key again."""
    by_swap = applied is not None and predicted == applied.predicted_step_seconds
    if predicted is None or policy.pinned_step or (by_swap and not applied.checked):
        return                  # (unchecked: made from a step the planner slowed, ``entry_of``)
    swap_predicted = (by_swap and profile.signature == applied.signature
                      and profile.n_forward > 0)
    if (mode_plan is not None
            and mode_plan.views_version != policy.modes.view_stamp(policy.modes.key)):
        # Planned from a keep view that changed since (learnt, corrected or thawed), or from
        # another size's where a nearer one is there now: the size is planned again
        # (``BlockModes.end_step``: at once where the view was another size's, through the
        # view's own correction otherwise), and a compute factor measured against the old
        # prediction would correct it twice. Measured on an H100 (HF Llama 4096x8): a size
        # whose first plans came from the slow first step missed twice, the warm view planned
        # it right, and the factor of 0.25 on top made it predict 0.11 s for steps of 0.44 s.
        # Only the view a plan was made from counts: when any view's change did (one for all),
        # on the CPU's hybrid benchmark 60% of the steps went unchecked, half of them 10% or
        # more off their prediction (on an H100 a 6k-token mix of the GPU demo ran 5-8x its
        # prediction for seven visits and was never planned again; that run did not record
        # whether this gate or its steps' pinning kept it from being checked).
        policy.checks.forget(("modes", policy.modes.key))
        if not swap_predicted:
            return
        # The prediction was a swap plan's, made from a step in these modes: it is checked on
        # its own until the new mode plan lands. Where the planner process was slow to answer
        # (a loaded 2-core machine), a swap plan that read a third of its step was otherwise
        # left standing for the 11 steps the mode plan took to land.
        mode_plan = None
    key = ("modes", policy.modes.key) if mode_plan is not None else ("swap", applied.signature)
    measured = profile.step_seconds
    stall = float(sum(profile.waits)) if profile.waits else 0.0
    f = 1.0 if mode_plan is None else _step_factor(policy, mode_plan, profile, stall)
    if not policy.checks.observe(key, predicted, measured, f):
        return
    t0 = time.perf_counter()
    link = profile.extra.get("link", {})
    if mode_plan is not None:
        hp, scale = mode_plan.hybrid, policy.modes.input_bytes / max(1, mode_plan.input_bytes)
        before = policy.link()
        after = policy.checks.correct_link(before, link, stall_fn(hp.profile, hp.swap,
                                                                   policy.ex.budget, scale), stall)
        pred = hp.predicted
        f = policy.checks.agreed(key)
        # Bytes the plan did not plan for but the guard had to move (it overrode the plan or
        # forced copies): the plan's memory model was short by that much, so it keeps a margin.
        # Moves that only came early or late are the link's or the compute's business, not a
        # margin's: a margin that grew on them (it never shrinks) once took a 25% budget below
        # what one block's recompute holds, and the mix fell back to swapping.
        missed = policy.ex.stats.offloaded_bytes - int(pred.moved_bytes * scale)
        key = policy.modes.key
        policy.modes.replan(key, f, missed if stall > pred.stall_seconds and policy._miss()
                            else 0)
        if any(abs(a / b - 1) > MISS for a, b in zip(after, before)):
            # The link is every size's: the other sizes' plans were made for the old one;
            # each is made again at the end of its size's next step (one plan per step).
            policy.modes.stale.update(k for k in policy.modes.plans if k != key)
        if swap_predicted:
            # The prediction that missed was the swap plan's (made from a step in these modes):
            # it is made again from this one too, or it would keep missing, and every second
            # step would plan the modes again (measured: a 4-block Llama re-planned its modes
            # on steps 4, 6 and 12, each time for a swap plan that read 324 ms of a 270 ms step).
            _remake_swap_plan(policy, profile, applied)
    elif profile.signature == applied.signature and profile.n_forward > 0:
        fit = None
        if not any(nbytes for nbytes, _ in link.values()):
            # Untimed copies (CUDA): the link is fitted to the stall of this step's plan.
            from ..planning.swaps import plan as make_plan
            tl = profile.to_timeline(*policy.link())
            fit = stall_fn(tl, make_plan(tl, policy.ex.budget), policy.ex.budget, 1.0)
        policy.checks.correct_link(policy.link(), link, fit, stall)
        _remake_swap_plan(policy, profile, applied)
    policy.planner_seconds += time.perf_counter() - t0


def _step_factor(policy, mode_plan, profile, stall: float) -> float:
    """The compute correction one step of ``mode_plan`` asks for (``compute_factor``, but 1
    where its miss is not the compute's).

    Where the step timed its recomputes, they are left out of both sides: what a recompute
    costs is learnt apart (``keep_views.full_ratio``, the selective probe) and a mix that
    recomputes is ranked by what it ran at. Counted in, one slow recompute made every mix's
    compute dearer: a test's 4-block net, whose recomputes sleep 40 ms each, ran all full at
    220 ms against 112 predicted, and the factor of 2 put keeping every block (110 ms when it
    ran) above it; the size recomputed for good in half the runs."""
    hp, scale = mode_plan.hybrid, policy.modes.input_bytes / max(1, mode_plan.input_bytes)
    pred, measured = hp.predicted, profile.step_seconds
    if pred is None:
        return 1.0
    total = pred.total_seconds
    recs = [c.recompute_seconds for c in profile.blocks or () if c.mode != "keep"]
    if recs and None not in recs:
        measured, total = measured - sum(recs), total - hp.recompute_seconds
    f = compute_factor(measured, stall, total * scale, pred.stall_seconds * scale)
    if f < 1.0 and stall > pred.stall_seconds * scale + MISS * pred.total_seconds * scale:
        # Waits the model did not foresee: it missed the copies, not the compute (taking
        # them for cheaper compute made a 4-block Llama's predictions fall to half the step).
        return 1.0
    if f > 1.0 and policy.ex.stats.offloaded_tensors:
        # Slower compute on a step that moved: what each move costs the compute thread
        # (timed per move, learn_moves), not the blocks.
        return 1.0
    return f


def _remake_swap_plan(policy, profile, applied) -> None:
    """The swap plan of ``profile``'s sequence made again from this step, as replanned: here, or
    in the planner process where plans are sent there (``swap_jobs``); the plan that missed
    stands until it lands."""
    entry = policy.swap_jobs.make(policy, profile, again=bool(applied.detailed))
    if entry is not None:
        policy.cache.put(entry)

"""What block-mode mixes ran at, per step size (policy side of the mode search's ``measured``).

A mode plan is chosen on a model; what the mix then runs at is the truth the model answers to.
Each step's time is kept against the mix it ran (its blocks' modes as run, so a probe or a block
run full for host room counts as the mix it made) and its step size; the faster of its last two
ranks the mix when its size is planned again (``planning.modes.plan_hybrid``). A shared machine's
noise only slows a step, and the mean of two let one slow step rank a mix above another it ran
faster than (HF Llama 256x4 at 75%, 384 tokens: swap only ran 139 ms, then 202 ms on a step
whose copies stalled; read at 170 ms, it lost to a mix at 153). The same count for every mix:
the middle of three (the low median of ``RUNS_KEPT``, until session 31) read a mix that ran
three steps slower than one as fast that ran two (a fallback after its trial), read at the
faster of its two. In three instrumented runs of the emulated-link benchmark's Llama at 25%,
each of the four times the search left a size's running mix it went to such a mix, one that
had run two steps against one read at the middle of three.

A mix's first step at a size runs on the guard's swap plan or one made from estimates, slower
than the mix will run: it stands for the mix until its second step replaces it. Left out, a mix
tried once looked untried and was tried again at every plan; kept, it made a mix that ran well
afterwards look worse than it was (HF Llama 256x4 at 50%: a first step of 468 ms beside steady
ones of 347 ms, and the size left the mix). A first step faster than the second stays beside
it, and the faster of the two ranks the mix: it stood in for nothing, the second was slowed (the
same Llama at 25%, 384 tokens: two blocks kept ran 216 ms, then 349 ms on a step whose copies
waited 56 ms; read at 349 against all full's 216, the size left the mix for good).

A plan's fallback (``HybridPlan.fallback``: the best other mix moving next to nothing) is run
against the mix the plan chose once per size (``Trials``), where the mix ran slower than
predicted and did not outrun its fallback's prediction (``outran``), or copies or recomputes
selectively and ran no faster than its fallback is predicted (``may_win``); after its second
step (the faster of its two: a fallback moves next to nothing, so its first step runs no
stand-in swap plan) the faster stays, by more than ``SWITCH_GAIN`` (one step's time varies by
10-30% on a shared CPU). Like with like (``reading``): the plan is read by the faster of its own
last two steps, so its trial waits until it has run two beside its stand-in, and that reading
also says whether it ran slower than predicted (by the low median of up to three, a plan on its
prediction was tried on noise in 182 of 400 scripted sizes, now 123).
Noise only slows a step, and the faster of two reads faster than one: against one step of the
plan, a fallback exactly as fast stayed in 27% of trials under a shared CPU's noise as
simulated (a step 1 + |N(0, 0.12)| of its time, one in five 10-50% slower), one 5% slower in
17%; against the faster of two, 9% and 4% (in a diagnostic run of the emulated-link
benchmark's Llama at 25%, 256 tokens left five kept blocks for three on such a trial: the plan's
one step 0.396 s, the fallback's 0.340 s and 0.392 s). Three steps, the first standing in, cost
the emulated-link benchmark's 25% runs a step per size at all full's time, about 4% over the
mix it kept, in a timed window of four visits a size; over 294 changes of mix in this project's
recorded runs, a new mix's first step read a median 1.04x the faster of its next two, the
spread of one step's noise against the faster of two. Until then the
size is not planned again (``BlockModes.replan`` puts it off): a plan made mid-trial took the
fallback as the mix the size runs, which another must beat by ``SWITCH_GAIN`` to replace, and
the trial never reached its verdict (the emulated-link benchmark's 8-block Llama at 25%, 384
tokens: three blocks kept ran 394-396 ms, then one kept ran 431-641 ms for the rest of the run).
Before any step after the engine's first was timed, a plan that copies or recomputes selectively
runs its fallback outright (``until_warm``).

The warnings a mode plan gives (no mix fits the budget, or the host room) are worded here too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from ..config import format_bytes
from ..planning.calibration import dominates, moving
from ..planning.modes import SWITCH_GAIN, HybridPlan
from ..planning.timeline import unmoved_peak


@dataclass
class ModePlan:
    """A size's mode plan as the block modes run it (``block_modes.BlockModes.plans``)."""
    modes: dict[int, str]       # runner block index -> mode
    working_set: dict[int, int]
    input_bytes: int
    budget: int
    measured: bool              # made from this key's own keep view (else scaled from another)
    hybrid: HybridPlan
    key: Optional[int] = None   # the step size it was made for
    replanned: bool = False     # made again after its predictions missed (not yet reported)
    move_seconds: float = 0.0   # the cost of a move it was planned with
    stand_in: bool = False      # runs its plan's fallback until a later step is timed
    views_version: tuple = ()   # the stamp of the keep view it was made from (``view_stamp``)
    keys: tuple = ()            # that view's tensor keys (``KeepView.keys``)
    entry: object = None        # (hybrid, its swap set as a plan by keys): ``swap_jobs.mode_entry``


RUNS_KEPT = 3                   # step times kept per mix and size (the last two rank it)
TRIAL_STEPS = 2                 # a fallback's steps on trial: the faster of them decides


def reading(secs: list) -> float:
    """What a mix's kept step times ``secs`` (newest last) read as, wherever a mix's run is
    judged (ranked, checked against its prediction, on trial): the faster of the last
    ``TRIAL_STEPS``."""
    return min(secs[-TRIAL_STEPS:])


class MixRuns:
    def __init__(self) -> None:
        self.runs: dict[int, dict[tuple, list]] = {}    # key -> ((block, mode), ...) -> seconds
        self.steps: dict[tuple, int] = {}               # (key, mix) -> steps it ran
        self.budgets: dict[tuple, list] = {}            # (key, mix) -> its kept runs' budgets

    def add(self, key: int, calls: list, seconds: float,
            budget: Optional[int] = None) -> tuple[tuple, list, int]:
        """The step of ``key`` whose blocks' first calls are ``calls`` took ``seconds`` under
        ``budget``: returns its mix (sorted (block, mode) pairs), that mix's kept step times
        (newest last) and how many steps it has run at ``key``."""
        mix = tuple(sorted((c.block, c.mode) for c in calls))
        seen = self.runs.setdefault(key, {}).setdefault(mix, [])
        under = self.budgets.setdefault((key, mix), [])
        n = self.steps[key, mix] = self.steps.get((key, mix), 0) + 1
        if n == 2 and seen[0] > seconds:
            seen.clear()                 # the first step stood in until now (see above)
            under.clear()
        seen.append(seconds)
        under.append(budget)
        del seen[:-RUNS_KEPT], under[:-RUNS_KEPT]
        return mix, seen, n

    def _ran(self, key: int, block_ids: list):
        """(modes in ``block_ids`` order, the mix, its kept times) of each mix that ran at
        ``key`` on exactly these blocks."""
        for mix, secs in self.runs.get(key, {}).items():
            modes = dict(mix)
            if secs and set(modes) == set(block_ids):
                yield tuple(modes[b] for b in block_ids), mix, secs

    def measured(self, key: int, block_ids: list) -> dict:
        """Mixes (modes in ``block_ids`` order) that ran at ``key``, with the faster of their
        last ``TRIAL_STEPS`` kept times (the one where they have one)."""
        return {m: reading(secs) for m, _, secs in self._ran(key, block_ids)}

    def held(self, key: int, block_ids: list, budget: int) -> set:
        """Mixes (as ``measured``'s) whose kept runs at ``key`` all ran under a budget no larger
        than ``budget``: the guard held them to it, so they fit it as their times say
        (``planning.modes.plan_hybrid``'s ``held``; a run under a larger budget may not)."""
        return {m for m, mix, _ in self._ran(key, block_ids)
                if all(b is not None and b <= budget for b in self.budgets.get((key, mix), []))}



class Trials:
    """The fallback trials of ``block_modes.BlockModes``, one per size at most."""

    def __init__(self) -> None:
        self.by_key: dict = {}     # key -> (plan that ran, its time (start), the fallback's plan)

    def start(self, key: int, plan, ran: float):
        """``plan`` (a ``ModePlan``) with its mix replaced by its fallback's, to run next at
        ``key`` (``ran``: the faster of its mix's last ``TRIAL_STEPS`` steps, as the fallback's
        are read); None where it has no fallback, or the size had its trial, or the plan does
        no more work than its fallback (``dominates``: one kept block and seven full, nothing
        copied, against all full, where only noise can decide)."""
        fb, hp = plan.hybrid.fallback, plan.hybrid
        if fb is None or key in self.by_key or (
                hp.predicted is not None and fb.predicted is not None
                and dominates(hp.modes, hp.predicted, fb.modes, fb.predicted)):
            return None
        ids = list(plan.modes)
        tried = replace(plan, modes=dict(zip(ids, fb.modes)), hybrid=fb,
                        working_set=dict(zip(ids, fb.working_set)), replanned=True)
        self.by_key[key] = (plan, ran, tried)
        return tried

    def running(self, key: int, plan) -> bool:
        """``plan`` is the fallback on trial at ``key``, its verdict not yet given."""
        trial = self.by_key.get(key)
        return trial is not None and trial[2] is plan

    def back(self, key: int, n: int, seen: list):
        """After the fallback's ``n``-th step at ``key`` (``seen``: its kept step times, the
        first among them only where it was faster than the second): at its ``TRIAL_STEPS``-th,
        the plan to go back to where the fastest of those was not clearly faster than the plan
        ran (``start``'s ``ran``), else None (it stays); None before. The fastest, as mixes are
        ranked (noise only slows a step): decided on one step, the CPU demo's 160-token size
        went back to a mix at 130-134 ms after all full's second step read 190 ms, where
        checkpointing's steps ran 100-145 ms."""
        if n != TRIAL_STEPS:
            return None
        plan, ran, _ = self.by_key[key]
        self.by_key[key] = (plan, ran, None)      # decided: no longer running, never again
        return plan if reading(seen) > ran * (1 - SWITCH_GAIN) else None


def outran(hp, pred: float, ran: float) -> bool:
    """Whether mode plan ``hp``, predicted at ``pred`` seconds at this step's size and run at
    ``ran``, ran faster than its fallback is predicted to by more than ``SWITCH_GAIN``: the
    fallback could win its trial only on a model wrong about it by more than that. Asked also
    where the plan ran over its own prediction: its miss is taken as its own (its copies, or
    its compute, slower than modelled), the fallback, which moves next to nothing, at its
    prediction unscaled, the most it could gain. Measured (the emulated-link benchmark's 8-block
    Llama at 75%, 512 tokens: every block kept, 24 MB copied, ran 512-561 ms against 545
    predicted; its fallback, four blocks full, predicted 598 ms, ran 545-655 ms on its three
    steps of trial, half the size's six visits; and four blocks whose recompute sleeps 40 ms,
    all kept on a 1 GB/s emulated link: 100-118 ms against 102 predicted, and where two slow
    steps of three read 115 ms, over the prediction by 13%, all full, predicted 221-231 ms, ran
    its trial at 221-238 ms: 2 runs in 30 before this rule, three steps at 2.2x each)."""
    at = _fallback_at(hp, pred)
    return at is not None and at > ran * (1 + SWITCH_GAIN)


def may_win(hp, pred: float, ran: float) -> bool:
    """Whether the fallback of mode plan ``hp`` (predicted at ``pred`` seconds at this step's
    size, run at ``ran``) is predicted no slower than the plan ran: asked where the plan ran as
    predicted but its model is least sure of it (it copies, or recomputes selectively). Its run
    bore the model out; a fallback predicted slower could stay only on a model wrong by more
    than ``MISS`` about a mix that moves nothing, the kind it is surest of. Before (a trial
    wherever the fallback was predicted within ``SWITCH_GAIN`` of the run), such trials ran in
    the timed window of the emulated-link benchmark at 25%: HF Llama 256x8 at 384 tokens, three
    kept blocks ran 0.58-0.59 s as predicted (0.596 s), its fallback all full 0.55 and 0.70 s,
    and went back; two of a size's four timed visits at all full's time. Where either is not
    known, it may."""
    at = _fallback_at(hp, pred)
    return at is None or at <= ran


def _fallback_at(hp, pred: float) -> Optional[float]:
    """What mode plan ``hp``'s fallback is predicted to take at the size its own prediction is
    scaled to ``pred`` at (None where either is not known)."""
    fb, own = hp.fallback, hp.predicted
    if fb is None or fb.predicted is None or own is None or own.total_seconds <= 0 \
            or not math.isfinite(pred):
        return None
    return fb.predicted.total_seconds * pred / own.total_seconds


def source(p: Optional[ModePlan], key: Optional[int], visits: dict) -> Optional[str]:
    """plan_source of a step run on mode plan ``p`` at size ``key``: "replanned" (the first step
    on a plan made again after its predictions missed), "cache" (a size seen before, on its own
    plan, found in the plans kept per size), "planned" (the first visit of a size: its plan is
    made, or the nearest size's plan stands in); None when no mode plan ran."""
    if p is None or key is None:
        return None
    if p.replanned:
        p.replanned = False
        return "replanned"
    if p.key == key and visits.get(key, 0) > 0:
        return "cache"
    return "planned"


def until_warm(hp, warm: bool):
    """The mix to run of mode plan ``hp``: where compute was timed on the engine's first step
    alone (not ``warm``) and the plan copies or recomputes selectively, its fallback (kept and
    full blocks, next to nothing moved), where it has one. A first step runs slow (warm-up: on
    an H200 the demo's first plain step ran 2.6x its later time); planned from it, copies looked
    hidden, and the engine kept every block and moved the rest for ten steps at 3-9x
    checkpointing's step time. Also not ``warm``: a plan made from another size's view, scaled
    (on the CPU demo such a plan kept three blocks and moved 3.9 MB, predicted 60-67 ms, and ran
    84-102 ms where checkpointing ran 58-63 ms)."""
    if warm or hp.fallback is None or not moving(hp.modes, hp.predicted):
        return hp
    return hp.fallback


def upsized(plan: Optional[ModePlan], own: bool, input_bytes: int, budget: int,
            d2h: float, view=None) -> bool:
    """Whether a step of ``input_bytes`` whose size has no plan of its own (``own`` False) runs
    every block full instead of ``plan`` (made for the nearest size: a larger one where there is
    one): where what that plan's mix holds with nothing moved (its unmoved peak), scaled to this
    size, exceeds ``budget`` by more than the link (``d2h`` bytes/s) can copy out in the plan's
    forward, scaled. (Not its predicted peak: that has the plan's own copies taken out, and they
    grow with the size too.) With no plan at all yet (the first size's is still being made in
    the planner process), the same of ``view``, the nearest keep view (a ``KeepView``; None:
    none yet, the engine's first step, which runs kept to learn one): the emulated-link
    benchmark's 8-block Llama at 25% ran its second step, twice the first's length, with every
    block kept while the first size's plan was being made, the guard copying 65 MiB over a 140
    MB/s link: 1.06 s, where all full runs 0.72 s. The guard's copies of such an excess stall:
    on an H100 the demo's second step, twice the first's length, ran the first's plan at 620
    ms where checkpointing ran 250 ms (by this rule's arithmetic about 4.2 GiB over, 80 ms of
    copies against a forward of about 60). Full recomputation is the safe side, at about
    checkpointing's cost. Where the link hides the excess, the plan runs, and the size keeps
    its first visit's keep view (none comes of a step run full: HF Llama 256x4 at 75%, running
    its longest size full on its first visit left that size without one, and its mixes at 1.25x
    the plain step where swapping alone ran 1.10x)."""
    if own:
        return False
    if plan is not None and plan.hybrid.predicted is not None:
        held = max(plan.hybrid.predicted.peak_bytes, unmoved_peak(plan.hybrid.profile))
        prof, size = plan.hybrid.profile, plan.input_bytes
    elif plan is None and view is not None:
        prof, size = view.profile, view.input_bytes
        held = unmoved_peak(prof)
    else:
        return False
    scale = input_bytes / max(1, size)
    over = held * scale - budget
    return over > 0 and over / d2h > prof.starts[prof.n_forward] * scale


def no_mix_fits(budget: int, hp) -> str:
    """The warning for a mode plan (``hp``) whose mix, the smallest found, exceeds ``budget``."""
    k, sel, full = hp.counts()
    pred = hp.predicted
    return (f"chameleon-swap: no mix of kept, swapped and recomputed blocks fits the budget "
            f"of {format_bytes(budget)} for this step size without copies forced in "
            f"line; the smallest mix found (keep {k}, selective {sel}, full {full}, with "
            f"swapping) peaks at {format_bytes(pred.peak_bytes)}"
            f" and forces {pred.forced_offloads} copies. It runs that mix, and the guard "
            f"holds the budget by waiting for copies; raise the budget above that peak for "
            f"full speed")


def no_host_room(host_limit: int, hp) -> str:
    """The warning for a mode plan (``hp``) whose copies, the least found, exceed the host room."""
    k, sel, full = hp.counts()
    return (f"chameleon-swap: no mix of kept, swapped and recomputed blocks keeps its copies "
            f"within host_memory_limit={format_bytes(host_limit)} for this step size: "
            f"the one that moves least (keep {k}, selective {sel}, full {full}) would copy "
            f"{format_bytes(hp.predicted.moved_bytes)} to host memory. Blocks run full when the "
            f"host arena has no room left, and a step may still fail with HostMemoryError; raise "
            f"host_memory_limit or the budget")


def moved(planned, now, share: float) -> bool:
    """``now`` is off ``planned`` by more than ``share`` of it (a budget, a move's cost)."""
    return abs(now - planned) > share * max(1e-12 if isinstance(planned, float) else 1, planned)

"""Every activation-memory policy, simulated on the timeline model the planner uses.

Swap policies are plans over ``timeline.simulate`` (one compute stream, one FIFO copy stream each
way, the budget rules of the runtime):

* ``none``: nothing moves, no budget.
* ``sync-swap`` (like ``torch.autograd.graph.save_on_cpu``): every tensor is copied out as it is
  saved and back when backward needs it, compute waiting for each copy; only the tensor in use
  stays on the device.
* ``async-swap``: every tensor is copied out after its save, asynchronously, and copied back as
  late as it still arrives in time; no budget is enforced (what "offload everything" costs).
* ``guard``: the runtime's guard without a profile: when the budget would be passed, the earliest
  saved tensors go out first (keeping room for one more of the largest seen); copies back in the
  order backward needs them, as early as room allows.
* ``static``: the planner's plan for one step after warm-up, applied by save position to every
  step (the baseline of warm-up-frozen offload schedules).
* ``chameleon``: the planner's plan for each step's own profile (the adaptive loop once a
  sequence has been seen).
* ``hybrid``: chameleon with recomputation (``Chameleon(model=...)``): the hybrid planner
  (``planning.modes.plan_hybrid``) chooses per block keep, selective or full recomputation together with
  the swap set, on the step's block structure (analytic traces carry it; selective here re-runs
  the attention core, as ``selective-recompute`` does; traced ``--hf`` steps and steps recorded
  with ``model=`` carry per-block ``blocks`` figures instead, see below).

Planned policies copy out what their plan moves; copies come back as the runtime issues them:
the guard underneath prefetches as soon as room allows (``_swap_step``), which is never later than
the plan's own schedule, so the peak sits at the budget whenever the budget binds.

Recomputation (Chen et al. 2016; Korthikanti et al. 2022) needs the block structure that analytic
traces carry: ``full-recompute`` keeps only each block's input and re-runs the block's forward
just before its backward; ``selective-recompute`` drops only the attention core (softmax and
dropout outputs, the s^2 tensors) and re-runs it. Steps with ``blocks`` (traced ``--hf`` steps,
and steps recorded with ``Chameleon(model=..., trace_dir=...)``) use those instead: selective
keeps what the repository's selective checkpointing keeps (the block input and the outputs of
matmuls and attention; ``recompute/selective.py``) and re-runs the block's other forward ops;
a recorded block that never ran selective counts as full. Their memory is swept slot by slot (the
timeline's spans are saved in forward only; recomputed tensors are saved in backward).

``swap_only_bound``: when forward ends every tensor has been saved and none released, so at least
``E`` bytes (the natural peak's excess over the budget) must be off the device by then, all through
the one D2H stream; those that backward needs (all but ``U`` bytes) come back after that moment,
through the one H2D stream. So no swap schedule that holds the budget ends sooner than
``max(forward, E / d2h) + max(backward, (E - U) / h2d)``. Recomputation escapes this bound by
redoing compute instead; its own bound is its compute.
"""
from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from ..planning.swaps import fetch_schedule, plan as make_plan
from ..planning.timeline import Plan, Prediction, simulate
from ..runtime.trace import Step, Trace
from .block_policies import hybrid_step, recompute_step

SWAP = ("none", "sync-swap", "async-swap", "guard", "static", "chameleon")
RECOMPUTE = ("full-recompute", "selective-recompute")
POLICIES = SWAP[:1] + RECOMPUTE + SWAP[1:] + ("hybrid",)
BUDGETED = ("guard", "static", "chameleon", "hybrid")     # policies that hold a budget
TP_RE = re.compile(r"^tp([1-9][0-9]*)$")


@dataclass
class StepResult:
    step_seconds: float
    stall_seconds: float
    peak_bytes: int          # most saved-activation bytes on the device at once
    moved_bytes: int         # copied device -> host
    compute_seconds: float   # the step's own compute, recomputation included
    lower_bound_seconds: float
    # Peak as the runtime counts it (a tensor copied out synchronously because no room could be
    # made is never counted; ``peak_bytes`` includes it, since the device held it for a moment).
    counted_peak_bytes: Optional[int] = None


@dataclass
class Result:
    policy: str
    budget_bytes: Optional[int]
    steps: list = field(default_factory=list)      # StepResult per trace step
    fits: Optional[bool] = None
    device_bytes: int = 0                          # model states + peak + workspace (most steps)
    host_bytes: int = 0                            # activations on the host at most
    tokens: int = 0                                # per step

    @property
    def step_seconds(self) -> float:
        return sum(s.step_seconds for s in self.steps) / len(self.steps)

    @property
    def stall_seconds(self) -> float:
        return sum(s.stall_seconds for s in self.steps) / len(self.steps)

    @property
    def peak_bytes(self) -> int:
        return max(s.peak_bytes for s in self.steps)

    @property
    def moved_bytes(self) -> int:
        return round(sum(s.moved_bytes for s in self.steps) / len(self.steps))

    @property
    def lower_bound_seconds(self) -> float:
        return sum(s.lower_bound_seconds for s in self.steps) / len(self.steps)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.step_seconds if self.step_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        """The documented ``--json`` entry."""
        return {"step_seconds": self.step_seconds, "stall_seconds": self.stall_seconds,
                "peak_bytes": self.peak_bytes, "moved_bytes": self.moved_bytes, "fits": self.fits}


def check_policy(name: str, arg: str = "policy") -> str:
    if name in POLICIES or TP_RE.match(name):
        return name
    raise ValueError(f"{arg}: unknown policy {name!r}; choose from {', '.join(POLICIES)}, or "
                     f"tpN (tensor parallelism of degree N without swapping, e.g. tp2, tp8)")


# ------------------------------------------------------------------------------- lower bound
def swap_only_bound(step: Step, budget: Optional[int], d2h: float, h2d: float) -> float:
    """The least time a swap schedule holding ``budget`` can take on ``step`` (see above)."""
    compute = step.compute_seconds
    if budget is None:
        return compute
    excess = step.activation_bytes - budget
    if excess <= 0:
        return compute
    forward = float(sum(step.segments[:step.n_forward]))
    never = sum(t.nbytes for t in step.tensors if t.first_used_at >= step.n_slots)
    return (max(forward, excess / d2h)
            + max(compute - forward, max(0, excess - never) / h2d))


# ------------------------------------------------------------------------------- swap policies
def guard_moves(step: Step, budget: int, min_tensor_bytes: int = 0) -> frozenset:
    """The tensors the guard copies out, from sizes alone: before a save, room for it (large
    tensors first, then small ones); after it, room for one more of the largest seen (at most
    half the budget), from large tensors only; earliest saved first."""
    large: deque = deque()
    small: deque = deque()
    move: set = set()
    staying = largest = 0

    def down_to(target: int, queues) -> None:
        nonlocal staying
        for q in queues:
            while staying > target and q:
                k = q.popleft()
                move.add(k)
                staying -= step.tensors[k].nbytes

    for j, t in enumerate(step.tensors):
        if not t.movable:
            staying += t.nbytes
            continue
        largest = max(largest, t.nbytes)
        down_to(budget - t.nbytes, (large, small))
        (large if t.nbytes >= min_tensor_bytes else small).append(j)
        staying += t.nbytes
        down_to(budget - min(largest, budget // 2), (large,))
    return frozenset(move)


def _eager(step: Step, move) -> dict:
    n_f = step.n_forward
    return {j: n_f for j in move if step.tensors[j].first_used_at < step.n_slots}


def _frozen_on(frozen: Plan, src: Step, dst: Step) -> Plan:
    """A plan made for ``src`` applied to ``dst`` by save position, as the runtime's static
    policy (and the adaptive one on a sequence it has not seen) applies it: tensor ``j`` of
    ``dst`` moves when tensor ``j`` of ``src`` did."""
    n = min(len(src.tensors), len(dst.tensors))
    return Plan(frozenset(j for j in frozen.move if j < n))


def _swap_step(step: Step, policy: str, budget: Optional[int], d2h: float, h2d: float,
               given: Optional[Plan], min_tensor_bytes: int) -> tuple[Prediction, int]:
    """Predict one step; ``given`` is the plan a static or cold-started policy applies to it
    (None: the policy's own decision for this step)."""
    prof = step.profile(d2h, h2d)
    largest = max((t.nbytes for t in step.tensors), default=0)
    if policy == "none":
        return simulate(prof, Plan(frozenset()), None), 0
    if policy == "sync-swap":
        # Budget 0: every save is copied out synchronously; every use fetched on demand.
        return simulate(prof, Plan(frozenset()), 0), largest
    if policy == "async-swap":
        move = frozenset(j for j, t in enumerate(step.tensors) if t.movable and t.nbytes)
        return simulate(prof, Plan(move, fetch_schedule(prof, move)), None), 0
    if budget is None:
        return simulate(prof, Plan(frozenset()), None), 0
    if policy in ("chameleon", "static"):
        move = (given or make_plan(prof, budget)).move
    else:
        move = guard_moves(step, budget, min_tensor_bytes)   # the guard (and cold starts)
    # Copies back as the runtime issues them: the guard under every policy prefetches each
    # tensor on the host, in the order backward needs them, as soon as there is room (a plan's
    # later copy-back slot never holds one back); the planner's own schedule is never later.
    return simulate(prof, Plan(move, _eager(step, move)), budget), largest


class _Schedule:
    """Which plan each step of a trace runs under a planned policy.

    Warm (the default): ``static`` applies the plan made for step ``warmup`` to every step by save
    position; ``chameleon`` plans every step for itself (a sequence seen before). Cold, as the
    runtime starts: ``static`` runs the guard until its plan is frozen at the end of step
    ``warmup``; ``chameleon`` runs the guard on the first step, its own plan on a sequence seen
    before, and the previous step's plan by position on a new one.
    """

    def __init__(self, trace: Trace, policy: str, budget: Optional[int], d2h: float, h2d: float,
                 warmup: int, cold: bool) -> None:
        self.policy, self.budget, self.cold = policy, budget, cold
        self.d2h, self.h2d = d2h, h2d
        self.warmup = min(warmup, len(trace.steps) - 1)
        self.frozen = None
        if policy == "static" and budget is not None:
            src = trace.steps[self.warmup]
            self.frozen = (src, self._plan(src))
        self.seen: dict = {}
        self.prev: Optional[tuple] = None

    def _plan(self, step: Step) -> Plan:
        return make_plan(step.profile(self.d2h, self.h2d), self.budget)

    def given(self, i: int, step: Step):
        """(plan to apply or None, whether the policy runs the guard instead)."""
        if self.budget is None or self.policy not in ("static", "chameleon"):
            return None, False
        if self.policy == "static":
            if self.cold and i <= self.warmup:
                return None, True
            src, made = self.frozen
            return (made if src is step else _frozen_on(made, src, step)), False
        if not self.cold:
            return None, False
        sig = (step.tag, step.n_forward, len(step.tensors))
        own = self.seen.get(sig)
        out = (own, False) if own is not None else (
            (None, True) if self.prev is None else (_frozen_on(self.prev[1], self.prev[0], step),
                                                    False))
        if own is None:
            own = self.seen[sig] = self._plan(step)
        self.prev = (step, own)
        return out


# ------------------------------------------------------------------------------- entry point
def run(trace: Trace, policy: str, budget: Optional[int], *, link: Optional[tuple] = None,
        device_bytes: Optional[int] = None, host_bytes: Optional[int] = None,
        warmup: int = 1, min_tensor_bytes: int = 0, plan_cache: Optional[dict] = None,
        cold: bool = False) -> Result:
    """Simulate ``policy`` on every step of ``trace`` under an activation ``budget`` (bytes).

    ``link`` is (d2h, h2d) bytes/s (default: the trace's own); ``device_bytes`` the device memory
    the model may use and ``host_bytes`` the host RAM for swapped activations (``fits`` is None
    when neither is known). ``static`` freezes the plan of step ``warmup`` (or the last step of a
    shorter trace); ``cold`` starts planned policies as the runtime does (see ``_Schedule``).
    ``min_tensor_bytes`` is the guard's size class (the runtime's default is 1 MiB).
    """
    check_policy(policy)
    if TP_RE.match(policy):
        raise ValueError(f"{policy}: tensor parallelism changes the model's shapes; simulate it "
                         f"on a trace generated with tp={policy[2:]} (sim.commands does this)")
    d2h, h2d = link or trace.link or (None, None)
    if not d2h or not h2d:
        raise ValueError("link bandwidth unknown: the trace records none; pass link=(d2h, h2d) "
                         "or a hardware profile")
    if budget is not None and budget < 0:
        raise ValueError(f"budget must be >= 0 bytes or None; got {budget!r}")
    sched = _Schedule(trace, policy, budget, d2h, h2d, warmup, cold)
    cache = {} if plan_cache is None else plan_cache
    out = Result(policy=policy, budget_bytes=budget, tokens=trace.steps[0].tokens)
    need_dev = need_host = 0
    for i, step in enumerate(trace.steps):
        lb = swap_only_bound(step, budget if policy in BUDGETED else None, d2h, h2d)
        if policy in RECOMPUTE:
            total, peak = recompute_step(step, policy)
            r = StepResult(step_seconds=total, stall_seconds=0.0, peak_bytes=peak, moved_bytes=0,
                           compute_seconds=total, lower_bound_seconds=total)
        elif policy == "hybrid":
            key = ("hybrid", budget, d2h, h2d, step.n_forward, tuple(step.segments),
                   tuple((t.nbytes, t.saved_at, t.first_used_at, t.movable, t.block, t.kind)
                         for t in step.tensors))
            pred = cache.get(key)
            if pred is None:
                pred = cache[key] = hybrid_step(step, budget, d2h, h2d)
            compute = float(sum(step.segments)) + (pred.total_seconds - pred.stall_seconds
                                                   - step.compute_seconds)
            r = StepResult(step_seconds=pred.total_seconds, stall_seconds=pred.stall_seconds,
                           peak_bytes=max(pred.peak_bytes, pred.overflow_bytes),
                           moved_bytes=pred.moved_bytes, compute_seconds=compute,
                           lower_bound_seconds=pred.swap_only_bound_seconds,
                           counted_peak_bytes=pred.peak_bytes)
        else:
            given, guard = sched.given(i, step)
            mode = "guard" if guard else policy
            # Identical steps (analytic traces, recurring sequences) are simulated once; a
            # step under another step's plan is not cached.
            key = None if given is not None else (
                mode, budget, d2h, h2d, min_tensor_bytes, step.n_forward, tuple(step.segments),
                tuple((t.nbytes, t.saved_at, t.first_used_at, t.movable) for t in step.tensors))
            hit = cache.get(key) if key is not None else None
            if hit is None:
                hit = _swap_step(step, mode, budget, d2h, h2d, given, min_tensor_bytes)
                if key is not None:
                    cache[key] = hit
            pred, in_use = hit
            peak = max(pred.peak_bytes, pred.overflow_bytes, in_use if pred.moved_bytes else 0)
            r = StepResult(step_seconds=pred.total_seconds, stall_seconds=pred.stall_seconds,
                           peak_bytes=peak, moved_bytes=pred.moved_bytes,
                           compute_seconds=step.compute_seconds,
                           lower_bound_seconds=max(lb, pred.swap_only_bound_seconds)
                           if policy in BUDGETED else pred.swap_only_bound_seconds,
                           counted_peak_bytes=pred.peak_bytes)
        out.steps.append(r)
        need_dev = max(need_dev, step.model_state_bytes + r.peak_bytes + step.workspace_bytes)
        need_host = max(need_host, r.moved_bytes)
    out.device_bytes, out.host_bytes = need_dev, need_host
    if device_bytes is not None or host_bytes is not None:
        out.fits = ((device_bytes is None or need_dev <= device_bytes)
                    and (host_bytes is None or need_host <= host_bytes))
    return out

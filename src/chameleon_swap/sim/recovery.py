"""Recovery from lost ranks, planned on the pipeline simulator: which strategy keeps a
data x pipeline x tensor parallel run closest to failure-free until the lost ranks come back.

The setting follows Odyssey (Luo et al., arXiv 2508.21613): the best recovery depends on the
job and on where the failure lands, and one performance model can choose. Odyssey reports
staying within 11% of failure-free throughput, with up to 1.229x Oobleck's and 1.355x Recycle's
average throughput on 32 GPUs (facts from the paper; this module is our own model of them).

Ranks are numbered ``rank = (replica * pp + stage) * tp + t``. A failed rank takes its whole
tensor-parallel group with it (a group cannot run short of a shard): the unit of layout is a
*group* of ``tp`` ranks, one pipeline stage of one data-parallel replica.

Strategies (each a ``Plan``):

* ``rerouting`` (Recycle-like, Gandhi et al. SOSP'24): the damaged replicas keep their other
  stages; the lost stage's micro-batches go to the same stage of the healthy replicas, which
  already hold its weights (nothing moved). With ``k`` of ``dp`` replicas missing stage ``s``,
  a peer of stage ``s`` runs ``m + ceil(m * k / (dp - k))`` micro-batches, and holds the
  rerouted ones beside its own: modeled as micro-batches ``g = 1 + ceil(k / (dp - k))`` times
  larger (activations and compute scale with tokens), ``ceil((m + extra) / g)`` of them. The
  step is that peer's pipeline (the slowest). Impossible when every replica lost the same stage.
* ``reconfiguration`` (Oobleck-like, Jang et al. SOSP'23): the healthy replicas keep their
  pipelines; the damaged ones shrink to their surviving stages, or pool their survivors into
  as few pipelines of at most ``pp`` stages as hold them (heterogeneous pipeline templates),
  layers re-balanced over each pipeline's stages; the global batch's micro-batches go to
  whichever pipeline would finish first with one more. Fewer stages per pipeline hold more
  layers: more model states and activations per rank. Every group fetches the layers' model
  states it did not hold (each new stage is given to the surviving group whose old layers
  overlap it most).
* ``ours``: the better of the two (over the horizon, below) with the engine's budget re-planned
  per rank: each pipeline runs the fastest of the simulator's memory modes that fits
  (``none``, ``recompute``, ``engine``: keep and swap under the rank's budget, ``hybrid``: keep,
  swap and recompute per block), where the baselines have only ``none`` and full ``recompute``
  (what Recycle and Oobleck run). Layouts whose activations do not fit become possible.

Failure-free reference: the original layout with the fastest fitting mode of all four.

Time to recover (assumptions, stated): ``restart_seconds`` (default 30 s) for re-rendezvous,
process restart and communicator set-up, the same for every strategy; plus the most bytes of
model state any one rank must fetch over the network at ``network_bytes_per_s`` (default
25 GB/s, one 200 Gb/s InfiniBand HDR port per GPU), transfers in parallel across ranks.
Rerouting moves nothing unless optimizer states are sharded (``dp_shard > 1``: the lost shards
are read back from the checkpoint at the same rate).

Horizon: the lost ranks are back after ``steps_to_repair`` steps. A strategy's average
throughput over the horizon is ``steps * global tokens / (recover + steps * step)``; ``ours``
picks the best, and shares are against failure-free throughput. What it leaves out: the move
back after repair, the optimizer step and data-parallel collectives (as ``sim/pipeline.py``).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .hardware import Hardware
from .models import ModelConfig
from .pipeline import MODES, stage_costs, simulate_pipeline

STRATEGIES = ("rerouting", "reconfiguration", "ours")
BASELINE_MODES = ("none", "recompute")
DEFAULT_RESTART_SECONDS = 30.0
DEFAULT_NETWORK_BYTES_PER_S = 25e9


class RecoveryError(ValueError):
    """The lost ranks leave no way to continue (too few survivors, or no layout that fits)."""


@dataclass
class Layout:
    dp: int
    pp: int
    tp: int
    micro_batches: int
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        for k in ("dp", "pp", "tp", "micro_batches"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"--{k.replace('_', '-')} must be a positive int; got {v!r}")

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    def group_of(self, rank: int) -> tuple[int, int]:
        """(replica, stage) of ``rank``."""
        g = rank // self.tp
        return divmod(g, self.pp)


@dataclass
class Pipe:
    stages: int
    micro_batches: int
    mode: str
    step_seconds: float
    peak_bytes: int             # the most any of its ranks holds (states, activations, workspace)


@dataclass
class Plan:
    strategy: str
    feasible: bool
    reason: str = ""
    step_seconds: float = math.inf
    recover_seconds: float = 0.0
    moved_bytes: int = 0                    # the most model-state bytes one rank fetches
    pipes: list = field(default_factory=list)
    modes: list = field(default_factory=list)
    peak_bytes: int = 0
    ranks_used: int = 0
    share: float = 0.0                      # steady throughput / failure-free
    horizon_share: float = 0.0              # over the horizon, recovery included
    choice: Optional[str] = None            # ours: which strategy it chose

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("strategy", "feasible", "reason", "recover_seconds",
                                            "moved_bytes", "modes", "peak_bytes", "ranks_used",
                                            "share", "horizon_share", "choice")}
        d["step_seconds"] = self.step_seconds if math.isfinite(self.step_seconds) else None
        d["pipelines"] = [p.__dict__ for p in self.pipes]
        return d


class _Pipes:
    """Cached pipeline simulations: the fastest fitting mode of ``modes`` for a pipeline of
    ``stages`` stages running ``k`` micro-batches of ``cfg`` scaled by ``scale`` tokens."""

    def __init__(self, cfg: ModelConfig, hw: Hardware, schedule: str):
        self.cfg, self.hw, self.schedule = cfg, hw, schedule
        self.cache: dict = {}

    def run(self, stages: int, k: int, modes: Sequence[str], scale: int = 1) -> Optional[Pipe]:
        key = (stages, k, tuple(modes), scale)
        if key not in self.cache:
            cfg = self.cfg.replace(micro_batch=self.cfg.micro_batch * scale)
            best = None
            if stages <= cfg.layers:
                for mode in modes:
                    r = simulate_pipeline(cfg, self.hw, stages, k, self.schedule, mode)
                    if r.fits and (best is None or r.step_seconds < best.step_seconds):
                        best = Pipe(stages, k, mode, r.step_seconds, r.max_total_bytes)
            self.cache[key] = best
        return self.cache[key]


def failed_ranks(layout: Layout, fail) -> list[int]:
    """``fail``: a count (spread evenly over the ranks: ``i * world // n``) or a list of ranks."""
    if isinstance(fail, int) and not isinstance(fail, bool):
        if not 1 <= fail <= layout.world:
            raise ValueError(f"--fail must be between 1 and the world size {layout.world}; "
                             f"got {fail}")
        return sorted({i * layout.world // fail for i in range(fail)})
    ranks = sorted(set(fail))
    if not ranks:
        raise ValueError("--fail must name at least one rank")
    bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < layout.world]
    if bad:
        raise ValueError(f"--fail: ranks must be in 0..{layout.world - 1}; got {bad}")
    return ranks


def _horizon(plan: Plan, ff_step: float, steps: int) -> None:
    if plan.feasible:
        plan.share = ff_step / plan.step_seconds
        plan.horizon_share = steps * ff_step / (plan.recover_seconds + steps * plan.step_seconds)


def _rerouting(layout: Layout, lost: set, pipes: _Pipes, modes, restart: float, net: float,
               cfg: ModelConfig) -> Plan:
    plan = Plan("rerouting", False)
    dp, m = layout.dp, layout.micro_batches
    per_stage: dict[int, int] = {}
    for _, s in lost:
        per_stage[s] = per_stage.get(s, 0) + 1
    k = max(per_stage.values())
    if k >= dp:
        plan.reason = (f"every data-parallel replica lost stage "
                       f"{[s for s, n in per_stage.items() if n >= dp]}: no peer holds its "
                       f"weights")
        return plan
    extra = math.ceil(m * k / (dp - k))
    g = 1 + math.ceil(k / (dp - k))
    pipe = pipes.run(layout.pp, math.ceil((m + extra) / g), modes, g)
    if pipe is None:
        plan.reason = (f"a peer of the lost stage holds {g}x the micro-batch's activations and "
                       f"no mode of {', '.join(modes)} fits it")
        return plan
    moved = 0
    if cfg.dp_shard > 1:
        moved = max(c.state for c in stage_costs(cfg, pipes.hw, layout.pp))
    plan.feasible, plan.step_seconds, plan.pipes = True, pipe.step_seconds, [pipe]
    plan.modes, plan.peak_bytes = [pipe.mode], pipe.peak_bytes
    plan.moved_bytes, plan.recover_seconds = moved, restart + moved / net
    plan.ranks_used = (layout.dp * layout.pp - len(lost)) * layout.tp
    return plan


def _bounds(layers: int, n: int) -> list[tuple[int, int]]:
    base, extra = divmod(layers, n)
    out, a = [], 0
    for s in range(n):
        b = a + base + (1 if s < extra else 0)
        out.append((a, b))
        a = b
    return out


def _moved(layout: Layout, lost: set, shapes: list[int], layer_state: list[int]) -> int:
    """The most model-state bytes one surviving group must fetch to hold its new stage, each new
    stage given to the free survivor whose old layers overlap it most."""
    L = len(layer_state)
    old = _bounds(L, layout.pp)
    free: dict[int, int] = {}            # old stage -> surviving groups not yet given a stage
    for d in range(layout.dp):
        for s in range(layout.pp):
            if (d, s) not in lost:
                free[s] = free.get(s, 0) + 1
    prefix = [0]
    for b in layer_state:
        prefix.append(prefix[-1] + b)
    worst = 0
    for p in shapes:
        for a, b in _bounds(L, p):
            best, gain = None, -1
            for s, n in free.items():
                if n:
                    lo, hi = max(a, old[s][0]), min(b, old[s][1])
                    ov = prefix[hi] - prefix[lo] if hi > lo else 0
                    if ov > gain:
                        best, gain = s, ov
            free[best] -= 1
            worst = max(worst, prefix[b] - prefix[a] - gain)
    return worst


def _spread(total: int, shapes: list[int], pipes: _Pipes, modes, m0: int):
    """The global batch's ``total`` micro-batches over pipelines of ``shapes`` stages, each next
    one to whichever pipeline would finish first with it (a pipeline's step taken as affine in
    its micro-batches, fitted on two simulations, then simulated at the counts chosen); None
    when a pipeline fits no mode."""
    fit = {}
    for p in set(shapes):
        a = pipes.run(p, m0, modes)
        if a is None:
            return None
        b = pipes.run(p, 2 * m0, (a.mode,))
        if b is None:
            return None
        slope = (b.step_seconds - a.step_seconds) / m0
        fit[p] = (a.mode, a.step_seconds - slope * m0, slope)
    counts = [0] * len(shapes)

    def t(i: int, k: int) -> float:
        _, icpt, slope = fit[shapes[i]]
        return icpt + slope * k

    heap = [(t(i, 1), i) for i in range(len(shapes))]
    heapq.heapify(heap)
    for _ in range(total):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (t(i, counts[i] + 1), i))
    out = [pipes.run(p, k, (fit[p][0],)) for p, k in zip(shapes, counts) if k]
    return None if any(r is None for r in out) else out


def _shapes(layout: Layout, lost: set) -> list[list[int]]:
    """Oobleck-like layouts of the survivors: the healthy replicas keep their pipelines; the
    damaged ones either shrink (each to its surviving stages, layers re-balanced) or pool their
    survivors into as few pipelines of at most ``pp`` stages as hold them, balanced."""
    lost_in = [sum(1 for d2, _ in lost if d2 == d) for d in range(layout.dp)]
    healthy = [layout.pp] * lost_in.count(0)
    shrunk = [layout.pp - n for n in lost_in if 0 < n < layout.pp]
    pool = sum(shrunk)
    out = [healthy + shrunk]
    if pool:
        n = math.ceil(pool / layout.pp)
        base, extra = divmod(pool, n)
        out.append(healthy + [base + 1] * extra + [base] * (n - extra))
    return [s for s in out if s]


def _reconfiguration(layout: Layout, lost: set, pipes: _Pipes, modes, restart: float,
                     net: float, layer_state: list[int]) -> Plan:
    plan = Plan("reconfiguration", False)
    G = layout.dp * layout.pp - len(lost)
    total = layout.dp * layout.micro_batches
    best = None
    for shapes in _shapes(layout, lost):
        got = _spread(total, shapes, pipes, modes, layout.micro_batches)
        if got is None:
            continue
        step = max(x.step_seconds for x in got)
        if best is None or step < best[0]:
            best = (step, got)
    if best is None:
        plan.reason = (f"no layout of the {G} surviving groups of {layout.tp} rank(s) fits "
                       f"with {', '.join(modes)}: a shorter pipeline's stages hold more layers")
        return plan
    step, got = best
    moved = _moved(layout, lost, [x.stages for x in got], layer_state)
    plan.feasible, plan.step_seconds, plan.pipes = True, step, got
    plan.modes = sorted({x.mode for x in got})
    plan.peak_bytes = max(x.peak_bytes for x in got)
    plan.moved_bytes, plan.recover_seconds = moved, restart + moved / net
    plan.ranks_used = sum(x.stages for x in got) * layout.tp
    return plan


@dataclass
class Recovery:
    layout: Layout
    failed: list
    lost_groups: int
    steps_to_repair: int
    failure_free: Pipe
    global_tokens: int
    plans: dict                             # strategy -> Plan (and the two halves of ours)

    @property
    def best(self) -> Plan:
        return self.plans["ours"]

    def as_dict(self) -> dict:
        return {"layout": self.layout.__dict__, "world": self.layout.world,
                "failed_ranks": self.failed, "lost_groups": self.lost_groups,
                "steps_to_repair": self.steps_to_repair,
                "failure_free": self.failure_free.__dict__,
                "failure_free_tokens_per_second":
                    self.layout.dp * self.layout.micro_batches * self.global_tokens_per_mb
                    / self.failure_free.step_seconds,
                "plans": {k: p.as_dict() for k, p in self.plans.items()}}

    @property
    def global_tokens_per_mb(self) -> int:
        return self.global_tokens // (self.layout.dp * self.layout.micro_batches)


def plan_recovery(cfg: ModelConfig, hw: Hardware, layout: Layout, fail,
                  steps_to_repair: int = 1000,
                  restart_seconds: float = DEFAULT_RESTART_SECONDS,
                  network_bytes_per_s: float = DEFAULT_NETWORK_BYTES_PER_S) -> Recovery:
    """Every strategy after the ranks ``fail`` (a count or a list) are lost; see the module
    docstring. Raises ``RecoveryError`` when nothing can continue."""
    if cfg.tp != layout.tp:
        cfg = cfg.replace(tp=layout.tp)
    if not isinstance(steps_to_repair, int) or steps_to_repair < 1:
        raise ValueError(f"--steps-to-repair must be a positive int; got {steps_to_repair!r}")
    if restart_seconds < 0:
        raise ValueError(f"restart_seconds must be >= 0; got {restart_seconds}")
    if network_bytes_per_s <= 0:
        raise ValueError(f"network_bytes_per_s must be positive; got {network_bytes_per_s}")
    if layout.pp > cfg.layers:
        raise ValueError(f"--pp {layout.pp} needs at least as many layers; {cfg.name} has "
                         f"{cfg.layers}")
    failed = failed_ranks(layout, fail)
    lost = {layout.group_of(r) for r in failed}
    survivors = layout.world - len(failed)
    groups = layout.dp * layout.pp - len(lost)
    if groups < 1:
        raise RecoveryError(f"too few survivors: {survivors} of {layout.world} ranks survive "
                            f"but no complete tensor-parallel group of {layout.tp} does; "
                            f"nothing can continue until a repair")
    pipes = _Pipes(cfg, hw, layout.schedule)
    ff = pipes.run(layout.pp, layout.micro_batches, MODES)
    if ff is None:
        raise RecoveryError(f"the failure-free layout (dp {layout.dp}, pp {layout.pp}, tp "
                            f"{layout.tp}) does not fit {hw.name} with any mode "
                            f"({', '.join(MODES)}); give a layout that fits (--pp, --tp)")
    layer_state = [c.state for c in stage_costs(cfg, hw, cfg.layers)]
    plans = {}
    for name, modes in (("rerouting", BASELINE_MODES), ("ours-rerouting", MODES)):
        plans[name] = _rerouting(layout, lost, pipes, modes, restart_seconds,
                                 network_bytes_per_s, cfg)
        plans[name].strategy = name
    for name, modes in (("reconfiguration", BASELINE_MODES), ("ours-reconfiguration", MODES)):
        plans[name] = _reconfiguration(layout, lost, pipes, modes, restart_seconds,
                                       network_bytes_per_s, layer_state)
        plans[name].strategy = name
    for p in plans.values():
        _horizon(p, ff.step_seconds, steps_to_repair)
    cands = [plans["ours-rerouting"], plans["ours-reconfiguration"]]
    ok = [p for p in cands if p.feasible]
    if not ok:
        raise RecoveryError(
            f"no layout of the {survivors} surviving ranks fits {cfg.name} on {hw.name}: "
            f"rerouting: {cands[0].reason}; reconfiguration: {cands[1].reason}")
    pick = max(ok, key=lambda p: p.horizon_share)
    ours = Plan(**{**pick.__dict__, "strategy": "ours",
                   "choice": pick.strategy.replace("ours-", "")})
    plans["ours"] = ours
    tokens = layout.dp * layout.micro_batches * cfg.tokens
    return Recovery(layout, failed, len(lost), steps_to_repair, ff, tokens, plans)

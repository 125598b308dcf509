"""Pipeline-parallel steps at scale: per-rank memory and step time of a schedule (1F1B,
interleaved, Chronos) with nothing, full recomputation, the schedule-aware engine, or the engine
with recomputation where the link cannot keep up (hybrid), per rank.

The model (one micro-batch) is the analytic trace of ``analytic.generate``: its ops' forward
and backward times and saved tensors are cut into stages by block (the embedding on the first
stage, the final norm, head and loss on the last), each rank holding its stages' model states.
The schedule's per-rank orders (``parallel/schedules``, the same orders the runtime executes)
are timed op by op with a point-to-point transfer of one micro-batch's hidden states between
ranks over the interconnect. Activations of a (stage, micro-batch) are held from its forward's
start to its backward's end.

* ``none``: everything kept.
* ``recompute``: full recomputation of every block (Megatron's "full"): each block keeps its
  input, the backward of a stage first repeats its blocks' forwards, and while it runs one block's
  activations are live again (the stage's largest block is added to the peak).
* ``engine``: the rank's activation budget is what device memory leaves after its model states
  and the workspace. A fluid model of the schedule-aware policy: when a forward would pass the
  budget, the bytes of the (stage, micro-batch) whose backward is farthest away go to the host;
  a backward brings its own host bytes back. The copies overlap the rank's compute; what the link
  cannot move within the rank's busy time is exposed, spread over the rank's ops, and the
  schedule is timed again.
* ``hybrid``: swap and recompute per stage under the engine's budget. Per rank, how many blocks
  of each (stage, micro-batch) to recompute, the rest kept or swapped as under ``engine``: the
  link carries what it can hide within the rank's busy time, the rest is recomputed (its blocks'
  forwards added to that micro-batch's backward). Searched per rank as the single-GPU hybrid
  planner does (``pipeline_plan.RankSearch``); never predicted slower than ``engine``, nor than
  ``recompute`` where that fits the budget.

Each mode is a plan per rank (``pipeline_plan.RankPlan``): the memory and traffic of a rank and
the time its backwards gain come from the same few lines whatever the mode.

What it leaves out: the optimizer step, data-parallel collectives, weight offload, and any
overlap of the point-to-point transfers with compute (they sit on the critical path).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..parallel.schedules import Op, Schedule, Timed, make_schedule, memory_over_time, time_schedule
from .analytic import generate
from .hardware import Hardware
from .models import ModelConfig
from .pipeline_plan import RankPlan, RankSearch

MODES = ("none", "recompute", "engine", "hybrid")


@dataclass
class StageCost:
    fwd: float = 0.0            # seconds, one micro-batch
    bwd: float = 0.0
    recompute: float = 0.0      # forward time of its blocks (repeated under full recompute)
    act: int = 0                # bytes saved for backward, one micro-batch
    kept: int = 0               # of which kept under full recompute (block inputs, non-block)
    block_act: int = 0          # largest single block's saved bytes
    state: int = 0              # model-state bytes (weights, gradients, optimizer)
    blocks: int = 0             # transformer blocks (layers) in the stage


@dataclass
class RankResult:
    rank: int
    stages: list
    state_bytes: int
    activation_peak_bytes: int
    budget_bytes: Optional[int]
    total_bytes: int            # states + activation peak + workspace
    fits: bool
    offloaded_bytes: int = 0
    fetched_bytes: int = 0
    stall_seconds: float = 0.0
    host_peak_bytes: int = 0
    recomputed_fraction: float = 0.0    # share of its block forwards that backwards repeat


@dataclass
class PipelineResult:
    schedule: str
    mode: str
    pp: int
    micro_batches: int
    step_seconds: float
    bubble_fraction: float
    tokens_per_second: float
    ranks: list
    layers: int = 0
    curves: list = field(default_factory=list, repr=False)   # per rank [(t, activation bytes)]

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks)

    @property
    def max_total_bytes(self) -> int:
        return max(r.total_bytes for r in self.ranks)

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("schedule", "mode", "pp", "micro_batches",
                                            "step_seconds", "bubble_fraction",
                                            "tokens_per_second", "fits", "layers")}
        d["ranks"] = [r.__dict__ for r in self.ranks]
        return d


def _layer_bounds(layers: int, n_stages: int) -> list[int]:
    """Stage of each layer: as equal runs as divide, the first stages one more (as
    ``workloads.pipeline.split_llama``)."""
    base, extra = divmod(layers, n_stages)
    out = []
    for s in range(n_stages):
        out += [s] * (base + (1 if s < extra else 0))
    return out


def stage_costs(cfg: ModelConfig, hw: Hardware, n_stages: int) -> list[StageCost]:
    if n_stages > cfg.layers:
        raise ValueError(f"{n_stages} stages need at least as many layers; the model has "
                         f"{cfg.layers}")
    step = generate(cfg, hw).steps[0]
    n, seg, blocks = step.n_forward, step.segments, step.segment_block
    layer_stage = _layer_bounds(cfg.layers, n_stages)
    first_block = next(i for i, b in enumerate(blocks) if b is not None)
    op_stage = [layer_stage[b] if b is not None else (0 if i < first_block else n_stages - 1)
                for i, b in enumerate(blocks)]
    costs = [StageCost() for _ in range(n_stages)]
    for i in range(n):
        c = costs[op_stage[i]]
        c.fwd += seg[i]
        c.bwd += seg[2 * n - 1 - i]
        if blocks[i] is not None:
            c.recompute += seg[i]
    per_block: dict[int, int] = {}
    for t in step.tensors:
        c = costs[op_stage[t.saved_at]]
        c.act += t.nbytes
        if t.block is None or t.kind == "block_input":
            c.kept += t.nbytes
        if t.block is not None:
            per_block[t.block] = per_block.get(t.block, 0) + t.nbytes
    for b, nbytes in per_block.items():
        c = costs[layer_stage[b]]
        c.block_act = max(c.block_act, nbytes)
    # Model states: per layer from the parameter count's difference, the embedding on the first
    # stage and everything else outside the layers (final norm, head) on the last.
    per_param = cfg.model_state_bytes() / cfg.params()
    layer_params = cfg.replace(layers=2).params() - cfg.replace(layers=1).params()
    emb = cfg.vocab * cfg.hidden + (cfg.seq * cfg.hidden if cfg.arch == "gpt" else 0)
    rest = cfg.params() - cfg.layers * layer_params - emb
    for s in layer_stage:
        costs[s].state += int(layer_params * per_param)
        costs[s].blocks += 1
    costs[0].state += int(emb * per_param)
    costs[-1].state += int(rest * per_param)
    return costs


def _timed(sched: Schedule, costs: list[StageCost], plans: list[RankPlan], comm: float,
           stalls: bool = True) -> Timed:
    """The schedule timed with each rank's plan: a backward gains its unit's recompute, and a
    rank's stall is spread over its ops (each scaled by ``1 + stall / busy``)."""
    scale = [1.0 + (p.stall / p.busy if stalls and p.stall else 0.0) for p in plans]

    def cost(op: Op) -> float:
        c, plan = costs[op.stage], plans[sched.stage_rank[op.stage]]
        base = c.fwd if op.kind == "F" else c.bwd + plan.extra[op.stage, op.mb]
        return base * scale[sched.stage_rank[op.stage]]
    return time_schedule(sched, cost, comm)


def _plans(mode: str, searches: list[RankSearch], sched: Schedule, costs: list[StageCost],
           comm: float) -> list[RankPlan]:
    if mode == "recompute":
        return [s.full() for s in searches]
    if mode != "hybrid":
        return [s.keep() for s in searches]
    # Each rank's best plan minimizes its own time; ranks wait on each other, so the schedule
    # is timed for the per-rank choice and for the two uniform ones (swap only, recompute
    # everything) and the fastest kept: never predicted slower than either.
    base = _timed(sched, costs, [s.keep() for s in searches], comm, stalls=False)
    cands = [[s.best(base) for s in searches], [s.keep() for s in searches],
             [s.full() for s in searches]]
    return min(cands, key=lambda plans: (not all(p.ok for p in plans),
                                         _timed(sched, costs, plans, comm).step_time))


def simulate_pipeline(cfg: ModelConfig, hw: Hardware, pp: int, micro_batches: int,
                      schedule: str = "1f1b", mode: str = "none",
                      budget: Optional[int] = None) -> PipelineResult:
    """One step of ``schedule`` on ``pp`` ranks, ``micro_batches`` micro-batches of ``cfg``
    (its seq and micro_batch), with ``mode`` on every rank (see the module docstring).
    ``budget`` (engine, hybrid): the activation budget of every rank; default what memory
    leaves."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    sched = make_schedule(schedule, pp, micro_batches)
    costs = stage_costs(cfg, hw, sched.stages)
    comm = cfg.tokens * cfg.hidden * cfg.elem / cfg.tp / hw.interconnect
    workspace = generate(cfg, hw).steps[0].workspace_bytes
    states = [sum(costs[s].state for s in sched.stages_of(r)) for r in range(pp)]
    budgets: list[Optional[int]] = [None] * pp
    if mode in ("engine", "hybrid"):
        budgets = [budget if budget is not None else max(0, hw.usable_bytes - st - workspace)
                   for st in states]
    searches = [RankSearch(sched, r, costs, budgets[r], hw.d2h, hw.h2d) for r in range(pp)]
    plans = _plans(mode, searches, sched, costs, comm)
    curves = memory_over_time(_timed(sched, costs, plans, comm, stalls=False),
                              lambda op: plans[sched.stage_rank[op.stage]].held[op.stage, op.mb])
    ranks = []
    for r, (plan, b) in enumerate(zip(plans, budgets)):
        mine = sched.stages_of(r)
        res = RankResult(r, mine, states[r], plan.activation_peak(b), b, 0, True,
                         plan.traffic.out, plan.traffic.back, plan.stall, plan.traffic.host_peak,
                         plan.recomputed_fraction(costs))
        res.total_bytes = states[r] + res.activation_peak_bytes + workspace
        res.fits = res.total_bytes <= hw.usable_bytes
        if b is not None:
            # A backward streams its own tensors back, so the budget must at least hold one
            # block's; the host must hold what is out.
            res.fits = (res.fits and plan.ok and b >= max(costs[s].block_act for s in mine)
                        and res.host_peak_bytes <= hw.host_memory_bytes)
        ranks.append(res)
    timed = _timed(sched, costs, plans, comm)
    return PipelineResult(schedule, mode, pp, micro_batches, timed.step_time,
                          timed.bubble_fraction(), micro_batches * cfg.tokens / timed.step_time,
                          ranks, cfg.layers, curves)


def largest_model(cfg: ModelConfig, hw: Hardware, pp: int, micro_batches: int, schedule: str,
                  mode: str, max_layers: Optional[int] = None) -> Optional[PipelineResult]:
    """The deepest model of ``cfg``'s shape (layers in steps of the stage count) that fits, with
    its result; None when even one layer per stage does not."""
    n_stages = make_schedule(schedule, pp, micro_batches).stages
    best = None
    layers = n_stages
    limit = max_layers or 8 * cfg.layers
    while layers <= limit:
        res = simulate_pipeline(cfg.replace(layers=layers), hw, pp, micro_batches, schedule, mode)
        if not res.fits:
            break
        best = (layers, res)
        layers += n_stages
    if best is None:
        return None
    layers, res = best
    res.layers = layers
    return res

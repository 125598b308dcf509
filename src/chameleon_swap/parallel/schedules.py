"""Pipeline schedules as data: which stage runs which micro-batch's forward or backward, in what
order on each rank, and when each happens under a cost model. Torch-free: the simulator
(``sim/pipeline.py``) times and sizes them at scale, and ``pipeline.py`` hands the same orders to
``torch.distributed.pipelining`` as a custom schedule, so what is simulated is what runs.

Three schedules:

* ``1f1b``: one stage per rank; rank ``r`` runs ``P - 1 - r`` forwards, then alternates one
  forward and one backward, then drains its backwards (PyTorch's ``Schedule1F1B`` order). The
  first stage holds the activations of ``P`` micro-batches at once, the last stage of one.
* ``interleaved``: ``V = 2`` stages per rank placed round robin (stage ``s`` on rank ``s % P``),
  Megatron's order (rank ``r`` warms up with ``P + 2 * (P - 1 - r)`` forwards): a smaller bubble
  than 1F1B, and even more activation memory on the first rank.
* ``chronos``: our reading of ChronosPipe's Chronos-Pipe (arXiv 2503.03182), with full backwards
  (no input/weight split): ``2P`` stages placed in a V, rank ``r`` holding the shallow stage ``r``
  and the deep stage ``2P - 1 - r``. Every rank then holds one stage whose activations are needed
  back soon (the deep one: its backward follows its forward after a short round trip) and one
  whose activations wait long (the shallow one), so the wait is spread evenly over the ranks
  instead of piling up on the first: activation memory is the same on every rank (1F1B's first
  rank's, in stage-sized units) and the bubble is a little smaller than 1F1B's. Which activations
  wait long is known from the order, and that is what the schedule-aware engine
  (``pipeline.py``) offloads first.

Every order is checked by ``time_schedule``: it raises when an order would deadlock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

SCHEDULES = ("1f1b", "interleaved", "chronos")


@dataclass(frozen=True)
class Op:
    kind: str        # "F" or "B" (full backward)
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


@dataclass
class Schedule:
    name: str
    ranks: int
    stages: int
    micro_batches: int
    stage_rank: list[int]            # stage -> rank
    orders: list[list[Op]]           # per rank, compute ops in execution order

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_rank) if r == rank]


@dataclass
class Timed:
    """A schedule timed under a cost model: every op's start and end."""
    schedule: Schedule
    start: dict[Op, float]
    end: dict[Op, float]

    @property
    def step_time(self) -> float:
        return max(self.end.values())

    def busy(self, rank: int) -> float:
        return sum(self.end[o] - self.start[o] for o in self.schedule.orders[rank])

    def bubble_fraction(self) -> float:
        """Share of rank-time spent idle within the step."""
        total = self.step_time * self.schedule.ranks
        return 1.0 - sum(self.busy(r) for r in range(self.schedule.ranks)) / total


def _check_args(pp: int, micro_batches: int) -> None:
    for name, v in (("pp", pp), ("micro_batches", micro_batches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int; got {v!r}")


def stage_ranks(name: str, pp: int) -> list[int]:
    """Stage -> rank placement of schedule ``name`` on ``pp`` ranks."""
    if name == "1f1b":
        return list(range(pp))
    if name == "interleaved":
        return [s % pp for s in range(2 * pp)]
    if name == "chronos":
        return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {name!r}")


def _deps(op: Op, n_stages: int) -> list[Op]:
    """Ops that must end before ``op`` starts (within a stage, micro-batches stay in order)."""
    out = []
    if op.kind == "F":
        if op.stage > 0:
            out.append(Op("F", op.stage - 1, op.mb))
        if op.mb > 0:
            out.append(Op("F", op.stage, op.mb - 1))
    else:
        out.append(Op("F", op.stage, op.mb))
        if op.stage < n_stages - 1:
            out.append(Op("B", op.stage + 1, op.mb))
        if op.mb > 0:
            out.append(Op("B", op.stage, op.mb - 1))
    return out


def _one_f_one_b(pp: int, m: int) -> list[list[Op]]:
    orders = []
    for r in range(pp):
        warm = min(pp - 1 - r, m)
        order = [Op("F", r, i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            order += [Op("F", r, f), Op("B", r, b)]
            f, b = f + 1, b + 1
        order += [Op("B", r, i) for i in range(b, m)]
        orders.append(order)
    return orders


def _chronos(pp: int, m: int) -> list[list[Op]]:
    """The V order with full backwards. Rank ``r`` holds the shallow stage ``r`` and the deep stage
    ``2P - 1 - r``: it warms up with ``2(P - r) - 1`` shallow forwards, then ``r`` pairs of deep
    and shallow forwards, then ``P - r`` deep forward/backward pairs (the deep stage's backward
    comes right after its forward: short lifetimes), then alternates shallow F, shallow B, deep F,
    deep B until every micro-batch is done."""
    orders = []
    for r in range(pp):
        lo, hi = r, 2 * pp - 1 - r
        n = {("F", lo): 0, ("B", lo): 0, ("F", hi): 0, ("B", hi): 0}
        order: list[Op] = []

        def emit(kind: str, stage: int) -> None:
            i = n[kind, stage]
            # A backward never passes its own stage's forward; nothing passes the last micro-batch.
            if i < m and (kind == "F" or i < n["F", stage]):
                order.append(Op(kind, stage, i))
                n[kind, stage] = i + 1

        for _ in range(2 * (pp - r) - 1):
            emit("F", lo)
        for _ in range(r):
            emit("F", hi)
            emit("F", lo)
        for _ in range(pp - r):
            emit("F", hi)
            emit("B", hi)
        while n["B", lo] < m or n["B", hi] < m:
            for kind, stage in (("F", lo), ("B", lo), ("F", hi), ("B", hi)):
                emit(kind, stage)
        orders.append(order)
    return orders


def _interleaved(pp: int, m: int, v: int = 2) -> list[list[Op]]:
    """Megatron's interleaved 1F1B order: micro-batches go through each rank's chunks in groups of
    ``pp``; rank ``r`` warms up with ``(v - 1) * pp + 2 * (pp - 1 - r)`` forwards."""
    if m % pp:
        raise ValueError(f"the interleaved schedule needs micro_batches divisible by pp ({pp}); "
                         f"got micro_batches={m}")

    def op(kind: str, k: int, r: int) -> Op:
        c = (k // pp) % v
        if kind == "B":
            c = v - 1 - c
        return Op(kind, c * pp + r, (k // (pp * v)) * pp + k % pp)

    orders = []
    for r in range(pp):
        total = v * m
        warm = min((v - 1) * pp + 2 * (pp - 1 - r), total)
        order = [op("F", k, r) for k in range(warm)]
        f = warm
        for b in range(total):
            if f < total:
                order.append(op("F", f, r))
                f += 1
            order.append(op("B", b, r))
        orders.append(order)
    return orders


def make_schedule(name: str, pp: int, micro_batches: int) -> Schedule:
    """The per-rank op orders of schedule ``name`` on ``pp`` ranks (see the module docstring)."""
    _check_args(pp, micro_batches)
    placement = stage_ranks(name, pp)
    if name == "1f1b":
        orders = _one_f_one_b(pp, micro_batches)
    elif name == "interleaved":
        orders = _interleaved(pp, micro_batches)
    else:
        orders = _chronos(pp, micro_batches)
    return Schedule(name, pp, len(placement), micro_batches, placement, orders)


def time_schedule(sched: Schedule, cost: Callable[[Op], float], comm: float = 0.0) -> Timed:
    """Start and end of every op when each rank runs its order and waits for dependencies
    (``comm`` seconds between ranks)."""
    start: dict[Op, float] = {}
    end: dict[Op, float] = {}
    pos = [0] * sched.ranks
    free = [0.0] * sched.ranks
    left = sum(len(o) for o in sched.orders)
    while left:
        progressed = False
        for r, order in enumerate(sched.orders):
            while pos[r] < len(order):
                op = order[pos[r]]
                deps = _deps(op, sched.stages)
                if any(d not in end for d in deps):
                    break
                t = max([free[r]] + [end[d] + (comm if sched.stage_rank[d.stage] != r else 0.0)
                                     for d in deps])
                start[op], end[op] = t, t + cost(op)
                free[r] = end[op]
                pos[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            stuck = [str(o[p]) for o, p in zip(sched.orders, pos) if p < len(o)]
            raise RuntimeError(f"pipeline schedule {sched.name!r} deadlocks at {stuck}")
    return Timed(sched, start, end)


def memory_over_time(timed: Timed, act_bytes: Union[Sequence[float], Callable[[Op], float]]
                     ) -> list[list[tuple[float, float]]]:
    """Per rank, (time, activation bytes held) after each change: a micro-batch's activations of
    stage ``s`` (``act_bytes[s]``, or ``act_bytes(op)`` where they differ by micro-batch) are held
    from its forward's start to its backward's end."""
    size = act_bytes if callable(act_bytes) else (lambda op: act_bytes[op.stage])
    out = []
    for r in range(timed.schedule.ranks):
        events = []
        for op in timed.schedule.orders[r]:
            if op.kind == "F":
                events.append((timed.start[op], 1, size(op)))
            else:
                events.append((timed.end[op], 0, -size(op)))
        events.sort()       # at equal times, frees (0) before allocations (1)
        level, curve = 0.0, [(0.0, 0.0)]
        for t, _, d in events:
            level += d
            curve.append((t, level))
        out.append(curve)
    return out


def backward_positions(sched: Schedule, rank: int) -> dict[tuple[int, int], int]:
    """(stage, micro-batch) -> position of its backward in ``rank``'s order: how soon it is
    needed, the key the schedule-aware policy ranks saved activations by."""
    return {(op.stage, op.mb): i for i, op in enumerate(sched.orders[rank]) if op.kind == "B"}

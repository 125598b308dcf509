"""What each pipeline rank keeps, swaps and recomputes: the per-rank plans behind the pipeline
simulator's memory modes (``sim/pipeline.py``), and the hybrid mode's search.

A rank's *plan* says, for every (stage, micro-batch) unit the rank runs, how many of the stage's
blocks that micro-batch recomputes. A recomputed block keeps only its input (Megatron's "full"
recomputation, per block): the unit then holds ``act - f * (act - kept)`` bytes from its forward
to its backward, ``f`` the share of the stage's blocks it recomputes, and its backward first
repeats those blocks' forwards (``f * recompute`` seconds). While a recomputed block's backward
runs its activations are live again, so a rank that recomputes anything keeps the largest such
block's bytes free (``reserve``). What the rank then holds above the budget goes to the host by
the schedule-aware fluid model (``fluid_traffic``): at each forward, the bytes of the units whose
backward is farthest away in the rank's order leave first, and a backward brings its own back.
The copies overlap the rank's compute (its busy time, recompute included); what the link cannot
move in that time is the rank's stall.

The modes as plans: ``none`` recomputes nothing and has no budget, ``recompute`` recomputes every
block, ``engine`` recomputes nothing under the budget, and ``hybrid`` (``RankSearch``) chooses.

Why per block of a unit, not per unit: at scale a stage holds tens of blocks and a rank runs a few
tens of units, so a whole unit is a coarse step (a unit of rank 0 under 1F1B is 1/P of its
activations); counting blocks lets the search stop where the link is just busy. Which blocks of a
unit are recomputed does not matter to this model: a stage's blocks are alike.

The hybrid search follows the single-GPU hybrid planner (``chameleon_swap.planning.modes``): families of
mixes along a conversion order, each searched on how many blocks convert (``best_count``), the
best kept. The rank's time is ``max(busy + recompute, link)``: recomputing a block costs its
forward and takes its bytes off the link, so the best mix swaps what the link can move within the
rank's busy time and recomputes the rest. Families: units by shortest wait between forward and
backward first (the planner's rule: those windows are the ones the link cannot hide), by longest
wait first (the units the engine would move), and the same number of blocks in every unit
(Megatron's uniform ``recompute_num_layers``). All-keep (the engine) and all-recompute are always
candidates, so a rank's plan is never predicted slower than either.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

from ..planning.ladder import best_count
from ..parallel.schedules import Op, Schedule, Timed, backward_positions


class Traffic(NamedTuple):
    out: int            # bytes copied to the host
    back: int           # bytes copied back
    host_peak: int      # the most bytes on the host at once
    natural: int        # the most bytes held at once with nothing moved


def fluid_traffic(order: Sequence[Op], need: dict, held: Callable[[tuple], float],
                  budget: Optional[float]) -> Traffic:
    """A rank running ``order`` under the schedule-aware policy at ``budget`` (None: no limit):
    unit ``(stage, mb)`` holds ``held(unit)`` bytes from its forward to its backward; ``need``
    is the position of each unit's backward (``backward_positions``)."""
    resident: dict[tuple, float] = {}
    host: dict[tuple, float] = {}
    out = back = on_host = level = live = natural = 0.0     # level: resident; live: held
    for op in order:
        key = (op.stage, op.mb)
        if op.kind == "B":
            r, h = resident.pop(key, 0.0), host.pop(key, 0.0)
            back += h
            level -= r
            live -= r + h
            continue
        resident[key] = float(held(key))
        host[key] = 0.0
        level += resident[key]
        live += resident[key]
        natural = max(natural, live)
        over = level - budget if budget is not None else 0.0
        for k in sorted(resident, key=lambda k: need[k], reverse=True):
            if over <= 0:
                break
            moved = min(resident[k], over)
            resident[k] -= moved
            host[k] += moved
            level -= moved
            out += moved
            over -= moved
        on_host = max(on_host, live - level)
    return Traffic(int(out), int(back), int(on_host), int(natural))


@dataclass
class RankPlan:
    recomputed: dict        # (stage, mb) -> blocks recomputed
    held: dict              # (stage, mb) -> bytes saved for backward, before any move
    extra: dict             # (stage, mb) -> seconds its backward gains (the recompute)
    reserve: int            # bytes kept free for one recomputed block's activations
    traffic: Traffic
    busy: float             # the rank's compute, recompute included
    stall: float            # what the link cannot move within ``busy``
    ok: bool                # the budget leaves room for the reserve

    @property
    def seconds(self) -> float:
        return self.busy + self.stall

    def activation_peak(self, budget: Optional[int]) -> int:
        kept = self.traffic.natural
        if budget is not None:
            kept = min(kept, max(0, budget - self.reserve))
        return kept + self.reserve

    def recomputed_fraction(self, costs: Sequence) -> float:
        """Share of the rank's block forwards that its backwards repeat."""
        total = sum(costs[s].blocks for s, _ in self.recomputed)
        return sum(self.recomputed.values()) / total if total else 0.0


class RankSearch:
    """Plans of rank ``rank`` of ``sched`` over stage costs ``costs`` (``StageCost``)."""

    def __init__(self, sched: Schedule, rank: int, costs: Sequence, budget: Optional[int],
                 d2h: float, h2d: float) -> None:
        self.order = sched.orders[rank]
        self.need = backward_positions(sched, rank)
        self.costs, self.budget, self.d2h, self.h2d = costs, budget, d2h, h2d
        self.units = [(op.stage, op.mb) for op in self.order if op.kind == "F"]
        self.busy = sum(costs[op.stage].fwd if op.kind == "F" else costs[op.stage].bwd
                        for op in self.order)
        self.size = [costs[s].blocks for s, _ in self.units]
        self._plans: dict[tuple, RankPlan] = {}

    def plan(self, counts: Sequence[int]) -> RankPlan:
        """The plan recomputing ``counts[i]`` blocks of unit ``self.units[i]``."""
        counts = tuple(counts)
        if counts in self._plans:
            return self._plans[counts]
        held, extra, reserve = {}, {}, 0
        for u, k in zip(self.units, counts):
            c = self.costs[u[0]]
            f = k / c.blocks
            held[u] = c.act - f * (c.act - c.kept)
            extra[u] = f * c.recompute
            if k:
                reserve = max(reserve, c.block_act)
        room = None if self.budget is None else self.budget - reserve
        traffic = fluid_traffic(self.order, self.need, held.__getitem__,
                                None if room is None else max(0, room))
        busy = self.busy + sum(extra.values())
        link = max(traffic.out / self.d2h, traffic.back / self.h2d)
        p = RankPlan(dict(zip(self.units, counts)), held, extra, reserve, traffic, busy,
                     max(0.0, link - busy), room is None or room >= 0)
        self._plans[counts] = p
        return p

    def keep(self) -> RankPlan:
        return self.plan([0] * len(self.units))

    def full(self) -> RankPlan:
        return self.plan(self.size)

    def key(self, p: RankPlan) -> tuple:
        """Within the budget first, then the least time, then the fewest blocks recomputed and
        the fewest bytes moved (so a tie goes to the simpler plan)."""
        scale = max(self.busy, 1e-12)
        return (not p.ok, round(p.seconds / scale, 9), sum(p.recomputed.values()), p.traffic.out)

    def along(self, units: Sequence[int]) -> Callable[[int], list[int]]:
        """The first ``k`` blocks along ``units`` (indices into ``self.units``), unit by unit."""
        def counts(k: int) -> list[int]:
            out = [0] * len(self.units)
            for i in units:
                out[i] = min(k, self.size[i])
                k -= out[i]
            return out
        return counts

    def uniform(self, k: int) -> list[int]:
        return [min(k, n) for n in self.size]

    def best(self, timed: Timed) -> RankPlan:
        """The hybrid plan: the least predicted time under the budget (``timed``: the schedule
        timed with nothing recomputed, for the waits)."""
        keep = self.keep()
        if keep.traffic.out == 0 and keep.ok:
            return keep                     # nothing to move: recomputing only costs time
        fwd = {(op.stage, op.mb): timed.end[op] for op in self.order if op.kind == "F"}
        wait = [timed.start[Op("B", s, mb)] - fwd[s, mb] for s, mb in self.units]
        short = sorted(range(len(self.units)), key=lambda i: (wait[i], i))
        families = [(self.along(short), sum(self.size)),
                    (self.along(short[::-1]), sum(self.size)),
                    (self.uniform, max(self.size))]
        cands = [keep, self.full()]
        for counts, n in families:
            k = best_count(lambda k: self.key(self.plan(counts(k))), n)
            cands.append(self.plan(counts(k)))
        return min(cands, key=self.key)

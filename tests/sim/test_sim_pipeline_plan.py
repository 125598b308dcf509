"""Per-rank plans of the pipeline simulator (sim/pipeline_plan.py): the fluid swap model moves
exactly what passes the budget, farthest backward first; a plan's recomputed blocks take their
bytes off the unit and add their forwards to its backward; the hybrid search picks the cheaper of
swapping and recomputing."""
from __future__ import annotations

import pytest

from chameleon_swap.parallel.schedules import backward_positions, make_schedule, time_schedule
from chameleon_swap.sim.pipeline import StageCost
from chameleon_swap.sim.pipeline_plan import RankSearch, fluid_traffic

GIB = 2**30


def _costs(n_stages: int) -> list[StageCost]:
    # Ten blocks a stage; recomputing all of them costs their forward (1 s) and keeps 2 of 10 GiB.
    return [StageCost(fwd=1.0, bwd=2.0, recompute=1.0, act=10 * GIB, kept=2 * GIB,
                      block_act=GIB, blocks=10) for _ in range(n_stages)]


def test_fluid_traffic_moves_what_passes_the_budget():
    sched = make_schedule("1f1b", 4, 8)
    order, need = sched.orders[0], backward_positions(sched, 0)
    t = fluid_traffic(order, need, lambda u: 10 * GIB, None)
    assert (t.out, t.back, t.host_peak, t.natural) == (0, 0, 0, 40 * GIB)
    t = fluid_traffic(order, need, lambda u: 10 * GIB, 25 * GIB)
    assert t.natural == 40 * GIB and t.host_peak == 15 * GIB
    assert t.out == t.back > 0
    # Rank 3 holds one micro-batch at a time: nothing passes a budget of one.
    assert fluid_traffic(sched.orders[3], backward_positions(sched, 3),
                         lambda u: 10 * GIB, 10 * GIB).out == 0


def test_a_plan_recomputes_blocks_of_a_unit():
    sched = make_schedule("1f1b", 2, 4)
    s = RankSearch(sched, 0, _costs(2), budget=None, d2h=1e9, h2d=1e9)
    counts = [0] * len(s.units)
    counts[1] = 5
    p = s.plan(counts)
    u = s.units[1]
    assert p.held[u] == pytest.approx(6 * GIB) and p.extra[u] == pytest.approx(0.5)
    assert p.held[s.units[0]] == 10 * GIB and p.extra[s.units[0]] == 0
    assert p.reserve == GIB and p.busy == pytest.approx(s.busy + 0.5)
    assert p.recomputed_fraction(_costs(2)) == pytest.approx(5 / 40)
    full = s.full()
    assert full.activation_peak(None) == 2 * 2 * GIB + GIB       # two units' inputs + one block
    assert full.recomputed_fraction(_costs(2)) == 1.0


@pytest.mark.parametrize("link, recomputes", [(1e12, False), (1e6, True)])
def test_the_search_weighs_the_link_against_recompute(link, recomputes):
    sched = make_schedule("1f1b", 4, 8)
    costs = _costs(4)
    timed = time_schedule(sched, lambda op: costs[op.stage].fwd if op.kind == "F"
                          else costs[op.stage].bwd)
    s = RankSearch(sched, 0, costs, budget=20 * GIB, d2h=link, h2d=link)
    best = s.best(timed)
    assert best.ok and best.activation_peak(20 * GIB) <= 20 * GIB
    assert best.seconds <= min(s.keep().seconds, s.full().seconds)
    assert (sum(best.recomputed.values()) > 0) == recomputes
    assert (best.traffic.out == 0) == recomputes


def test_a_budget_below_one_block_is_not_ok():
    sched = make_schedule("1f1b", 2, 2)
    s = RankSearch(sched, 0, _costs(2), budget=GIB // 2, d2h=1e9, h2d=1e9)
    assert s.keep().ok and not s.full().ok

"""Pipeline schedules as data (parallel/schedules.py): complete, deadlock-free orders; the memory
shape each schedule is known for; the timing and memory model on small hand-checked cases."""
from __future__ import annotations

import pytest

from chameleon_swap.parallel.schedules import (
    SCHEDULES, Op, Schedule, backward_positions, make_schedule, memory_over_time, stage_ranks,
    time_schedule)


def _unit(sched):
    v = sched.stages // sched.ranks
    return lambda op: (1.0 if op.kind == "F" else 2.0) / v


def _peaks(sched):
    v = sched.stages // sched.ranks
    timed = time_schedule(sched, _unit(sched))
    return [max(level for _, level in curve)
            for curve in memory_over_time(timed, [1.0 / v] * sched.stages)], timed


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("pp,m", [(1, 1), (2, 1), (2, 2), (2, 4), (3, 6), (4, 4), (4, 8), (8, 16)])
def test_every_op_once_on_its_rank_and_no_deadlock(name, pp, m):
    if name == "interleaved" and m % pp:
        pytest.skip("interleaved needs micro_batches divisible by pp")
    s = make_schedule(name, pp, m)
    want = sorted((k, st, mb) for k in "FB" for st in range(s.stages) for mb in range(m))
    assert sorted((o.kind, o.stage, o.mb) for order in s.orders for o in order) == want
    for r, order in enumerate(s.orders):
        assert all(s.stage_rank[o.stage] == r for o in order)
    time_schedule(s, _unit(s))          # raises on a deadlock


def test_placements():
    assert stage_ranks("1f1b", 4) == [0, 1, 2, 3]
    assert stage_ranks("interleaved", 2) == [0, 1, 0, 1]
    assert stage_ranks("chronos", 3) == [0, 1, 2, 2, 1, 0]
    with pytest.raises(ValueError, match="schedule must be one of"):
        stage_ranks("zb", 2)


def test_1f1b_memory_falls_with_the_stage_and_timing_matches_the_formula():
    peaks, timed = _peaks(make_schedule("1f1b", 4, 8))
    assert peaks == [4.0, 3.0, 2.0, 1.0]
    # (M + P - 1) * (F + B) for equal stages: 11 * 3.
    assert timed.step_time == 33.0
    assert timed.bubble_fraction() == pytest.approx(1 - 8 * 3 / 33)


def test_chronos_spreads_memory_evenly_and_is_no_slower_than_1f1b():
    for pp, m in [(2, 4), (4, 8), (4, 16), (8, 32)]:
        one, t1 = _peaks(make_schedule("1f1b", pp, m))
        chronos, tc = _peaks(make_schedule("chronos", pp, m))
        assert max(chronos) == max(one)
        assert min(chronos) == max(chronos)
        assert tc.step_time <= t1.step_time


def test_interleaved_needs_divisible_micro_batches():
    with pytest.raises(ValueError, match="divisible by pp"):
        make_schedule("interleaved", 4, 6)
    with pytest.raises(ValueError, match="micro_batches must be a positive int"):
        make_schedule("1f1b", 2, 0)


def test_a_deadlocking_order_raises():
    bad = Schedule("bad", 2, 2, 1, [0, 1], [[Op("B", 0, 0), Op("F", 0, 0)],
                                              [Op("F", 1, 0), Op("B", 1, 0)]])
    with pytest.raises(RuntimeError, match="deadlocks"):
        time_schedule(bad, lambda op: 1.0)


def test_backward_positions_rank_the_backwards_of_a_rank():
    s = make_schedule("1f1b", 2, 3)
    # rank 0: F0 F1 B0 F2 B1 B2
    assert [str(o) for o in s.orders[0]] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"]
    assert backward_positions(s, 0) == {(0, 0): 2, (0, 1): 4, (0, 2): 5}


def test_comm_delays_dependencies_between_ranks_only():
    s = make_schedule("1f1b", 2, 1)
    assert time_schedule(s, lambda op: 1.0).step_time == 4.0
    assert time_schedule(s, lambda op: 1.0, comm=0.5).step_time == 5.0

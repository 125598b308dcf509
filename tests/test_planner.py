"""planner.py: instances whose optimum is known, and properties on random ones."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_swap.planner import fetch_schedule, plan, rank
from chameleon_swap.timeline import Plan, Profile, Span, natural_peak, simulate

GB = 1e9


def prof(compute, n_forward, spans, d2h=GB, h2d=GB):
    return Profile(tuple(compute), n_forward, tuple(Span(*s) for s in spans), d2h, h2d)


def exhaustive(pr, budget):
    """The best total over every subset, each with every copy-back slot."""
    best = None
    n = len(pr.spans)
    for r in range(n + 1):
        for move in itertools.combinations(range(n), r):
            choices = [range(pr.n_forward, pr.spans[j].use + 1) for j in move]
            for fetch in itertools.product(*choices):
                p = simulate(pr, Plan(frozenset(move), dict(zip(move, fetch))), budget)
                if p.budget_ok and (best is None or p.total_seconds < best):
                    best = p.total_seconds
    return best


def test_nothing_moves_when_the_peak_fits_or_no_budget():
    pr = prof([1.0] * 5, 2, [(100, 0, 4), (50, 1, 3)])
    assert plan(pr, None).move == frozenset()
    assert plan(pr, 150).move == frozenset()
    assert plan(pr, 150).predicted.stall_seconds == 0


def test_the_one_span_whose_copies_hide_is_moved():
    # Budget 100 MB: one of the two must go. Span 0 has a 3 s window; span 1 is saved last and
    # needed first (window 1 s) - moving span 0 hides fully, moving span 1 would too but the
    # window ranking keeps the tail resident (LESSONS 10).
    pr = prof([1.0] * 6, 2, [(60_000_000, 0, 5), (60_000_000, 1, 3)])
    p = plan(pr, 100_000_000)
    assert p.move == frozenset({0})
    assert p.predicted.stall_seconds == 0 and p.predicted.peak_bytes <= 100_000_000
    assert rank(pr)[0] == 0


def test_a_big_span_saved_last_and_used_first_stays_resident():
    # Span 2 (large) is saved at the end of forward and needed at once: no window to hide a
    # copy. The optimum moves the two early spans instead.
    pr = prof([1.0, 1.0, 1.0, 0.01, 1.0, 1.0, 1.0], 3,
              [(40_000_000, 0, 6), (40_000_000, 1, 5), (500_000_000, 2, 4)], d2h=GB, h2d=GB)
    p = plan(pr, 520_000_000)
    assert 2 not in p.move
    # Span 1 cannot come back while span 2 is resident (no room), so 0.04 s of stall is optimal.
    assert p.predicted.stall_seconds == pytest.approx(0.04)
    assert p.predicted.total_seconds == pytest.approx(exhaustive(pr, 520_000_000))


def test_prefers_the_long_window():
    # Two equal spans, one must move; span 0's window is 3 s, span 1's 0.05 s, copies 0.1 s each.
    pr = prof([1.0, 1.0, 0.05, 1.0, 1.0, 1.0], 2, [(10**8, 0, 5), (10**8, 1, 3)])
    p = plan(pr, 10**8)
    assert p.move == frozenset({0})
    assert p.predicted.total_seconds == pytest.approx(exhaustive(pr, 10**8))


def test_fetch_schedule_is_late_but_in_time_and_fifo():
    pr = prof([1.0] * 8, 3, [(10**9, 0, 7), (10**9, 1, 6), (10**8, 2, 5)])
    f = fetch_schedule(pr, frozenset({0, 1}), margin_slots=0)
    # 1 s copies: span 1 needed at t=6 must start by 5 (slot 5); span 0 needed at 7, FIFO after
    # span 1's copy (which ends at 6): issued at slot 6.
    assert f == {1: 5, 0: 6}
    assert all(pr.n_forward <= f[j] <= pr.spans[j].use for j in f)
    p = simulate(pr, Plan(frozenset({0, 1}), f), None)
    assert p.stall_seconds == pytest.approx(0)


@st.composite
def instances(draw):
    n = draw(st.integers(1, 4))
    n_slots = 2 * n + 1
    compute = draw(st.lists(st.floats(0.01, 1.0), min_size=n_slots, max_size=n_slots))
    order = draw(st.permutations(range(n)))
    spans = [(draw(st.integers(10**6, 10**8)), i, n + 1 + order[i]) for i in range(n)]
    pr = prof(compute, n, spans, draw(st.floats(1e8, 1e10)), draw(st.floats(1e8, 1e10)))
    nat = natural_peak(pr)
    budget = draw(st.integers(max(s[0] for s in spans), nat))
    return pr, budget


@settings(max_examples=60, deadline=None)
@given(instances())
def test_random_plans_hold_the_budget_and_are_deterministic(case):
    pr, budget = case
    p = plan(pr, budget)
    assert p.predicted.peak_bytes <= budget and p.predicted.budget_ok
    assert all(pr.n_forward <= p.fetch_at[j] <= pr.spans[j].use for j in p.move)
    assert plan(pr, budget) == p
    # Never worse than moving nothing (the guard's forced copies).
    assert p.predicted.total_seconds <= simulate(pr, Plan(frozenset()), budget).total_seconds + 1e-9
    assert p.predicted.total_seconds >= exhaustive(pr, budget) - 1e-9

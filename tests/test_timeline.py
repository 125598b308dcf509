"""timeline.py: the cost model on hand-built timelines whose answers are worked out by hand."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_swap.timeline import Plan, Profile, Span, lower_bound, memory_curve, natural_peak, simulate

GB = 1e9


def prof(compute, n_forward, spans, d2h=GB, h2d=GB):
    return Profile(tuple(compute), n_forward, tuple(Span(*s) for s in spans), d2h, h2d)


# Two forward slots, a gap, two backward slots. Span 0 (100 MB) saved at the end of slot 0 and
# needed at the start of slot 4; span 1 (50 MB) saved at the end of slot 1, needed at slot 3.
TWO = prof([1.0, 1.0, 1.0, 1.0, 1.0], 2, [(100_000_000, 0, 4), (50_000_000, 1, 3)])


def test_no_moves_natural_peak_and_no_stall():
    p = simulate(TWO, Plan(frozenset()), None)
    assert p.peak_bytes == natural_peak(TWO) == 150_000_000
    assert p.stall_seconds == 0 and p.total_seconds == 5.0 and p.budget_ok


def test_one_hidden_move_lowers_the_peak_with_no_stall():
    # Span 0 (100 MB) out at t=1 (0.1 s); span 1 (50 MB) used and released in slot 3; span 0 is
    # needed at slot 5 (t=5) and issued at slot 4 (t=4): back at 4.1, hidden.
    pr = prof([1.0] * 6, 2, [(100_000_000, 0, 5), (50_000_000, 1, 3)])
    assert natural_peak(pr) == 150_000_000
    p = simulate(pr, Plan(frozenset({0}), {0: 4}), 100_000_000)
    assert p.stall_seconds == 0 and p.peak_bytes == 100_000_000 and p.budget_ok
    # Issued at slot 2 it finds no room (span 1 is resident until the end of slot 3): deferred
    # to slot 4, still in time.
    assert simulate(pr, Plan(frozenset({0}), {0: 2}), 100_000_000).stall_seconds == 0
    # Issued only at its use it waits its whole copy.
    q = simulate(pr, Plan(frozenset({0}), {0: 5}), 100_000_000)
    assert q.stall_seconds == pytest.approx(0.1)


def test_late_copy_back_stalls_by_the_exact_shortfall():
    slow = prof([1.0, 1.0, 1.0, 1.0, 1.0], 2, [(100_000_000, 0, 4), (50_000_000, 1, 3)],
                h2d=0.4 * GB)                      # 100 MB back takes 0.25 s
    p = simulate(slow, Plan(frozenset({0}), {0: 4}), None)
    assert p.stall_seconds == pytest.approx(0.25)
    assert p.total_seconds == pytest.approx(5.25)
    q = simulate(slow, Plan(frozenset({0}), {0: 3}), None)   # issued a slot early: hidden
    assert q.stall_seconds == 0


def test_forward_waits_for_copy_outs_when_d2h_is_slow():
    # Budget 120 MB: span 1 (50 MB) can be saved only once span 0's copy-out (100 MB at 50 MB/s
    # = 2 s, from t=1) has finished at t=3; span 1's save is at t=2, so compute waits 1 s.
    slow = prof([1.0, 1.0, 1.0, 1.0, 1.0], 2, [(100_000_000, 0, 4), (50_000_000, 1, 3)],
                d2h=0.05 * GB)
    p = simulate(slow, Plan(frozenset({0}), {0: 2}), 120_000_000)
    assert p.stall_seconds >= 1.0 - 1e-9
    assert p.peak_bytes <= 120_000_000 and p.budget_ok


def test_forced_copy_out_when_nothing_is_planned():
    # Budget 100 MB and no plan: span 1 does not fit next to span 0, nothing is in flight, so it
    # is copied out synchronously (50 MB at 1 GB/s = 0.05 s) and fetched on demand at its use.
    p = simulate(TWO, Plan(frozenset()), 100_000_000)
    assert p.peak_bytes == 100_000_000
    assert p.stall_seconds == pytest.approx(0.05 + 0.05)


def test_fifo_h2d_queues_copies_back():
    # Two spans of 1 GB each issued at the same slot: the second waits for the first.
    pr = prof([1.0, 1.0, 0.1, 1.0, 1.0], 2, [(10**9, 0, 4), (10**9, 1, 3)])
    both = Plan(frozenset({0, 1}), {0: 2, 1: 2})
    p = simulate(pr, both, None)
    # Copies out end at t=2 and t=3 (FIFO after the first). Copy back of span 1 (used at slot 3,
    # t=2.1) is issued at t=2 but waits for its copy-out (t=3) then takes 1 s: ready at t=4.
    assert p.stall_seconds > 0
    assert p.total_seconds == pytest.approx(sum(pr.compute) + p.stall_seconds)


def test_deferred_copy_back_for_lack_of_room():
    pr = prof([1.0, 1.0, 1.0, 1.0, 1.0], 2, [(100, 0, 4), (100, 1, 3)])
    # Budget 100: span 0 cannot come back at slot 2 (span 1 resident until the end of slot 3);
    # it is deferred to slot 4, its use: the copy is issued then and waited for.
    p = simulate(pr, Plan(frozenset({0}), {0: 2}), 100)
    assert p.peak_bytes <= 100
    assert p.stall_seconds == pytest.approx(100 / GB)


def test_lower_bound():
    pr = prof([0.1, 0.1, 0.1], 1, [(10**9, 0, 2)])
    assert lower_bound(pr, 0) == pytest.approx(0.3)
    assert lower_bound(pr, 10**9) == pytest.approx(1.0)
    p = simulate(pr, Plan(frozenset({0}), {0: 1}), None)
    assert p.total_seconds >= p.lower_bound_seconds - 1e-12


def test_memory_curve_ends_and_peaks_like_the_prediction():
    plan = Plan(frozenset({0}), {0: 2})
    curve = memory_curve(TWO, plan, None)
    assert max(b for _, b in curve) == simulate(TWO, plan, None).peak_bytes
    assert all(t2 >= t1 for (t1, _), (t2, _) in zip(curve, curve[1:]))


@st.composite
def instances(draw):
    n = draw(st.integers(1, 7))
    n_back = draw(st.integers(0, n))
    n_slots = n + 1 + n_back
    compute = draw(st.lists(st.floats(0.001, 1.0), min_size=n_slots, max_size=n_slots))
    spans = []
    for i in range(n):
        use = draw(st.integers(n, n_slots))
        spans.append((draw(st.integers(1, 10**8)), i, use))
    d2h = draw(st.floats(1e7, 1e10))
    h2d = draw(st.floats(1e7, 1e10))
    pr = prof(compute, n, spans, d2h, h2d)
    move = frozenset(draw(st.sets(st.integers(0, n - 1))))
    fetch = {j: draw(st.integers(n, max(n, spans[j][2]))) for j in move}
    budget = draw(st.one_of(st.none(), st.integers(max(s[0] for s in spans), 10**9)))
    return pr, Plan(move, fetch), budget


@settings(max_examples=120, deadline=None)
@given(instances())
def test_properties(case):
    pr, plan, budget = case
    p = simulate(pr, plan, budget)
    assert p.total_seconds >= p.lower_bound_seconds - 1e-9 or not plan.move
    assert p.total_seconds == pytest.approx(sum(pr.compute) + p.stall_seconds)
    assert p.stall_seconds >= 0
    assert simulate(pr, plan, budget) == p                       # deterministic
    if budget is not None:
        # Every span is movable and fits alone: the budget is held whatever the plan.
        assert p.peak_bytes <= budget and p.budget_ok
    if budget is None and not plan.move:
        assert p.stall_seconds == 0 and p.peak_bytes == natural_peak(pr)

"""The hybrid keep / selective / full planner on hand-built keep views (no torch)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from chameleon_swap.planning.modes import (Block, apply_modes, best_count, conversion_order,
                                   full_recompute_modes, plan_hybrid, working_set)
from chameleon_swap.planning.timeline import Plan, Profile, Span, simulate, unmoved_peak

MB = 2**20


def keep_view(n_blocks=4, per_block=3, nbytes=MB, fwd=1e-3, bw=1e9, selective=None,
              input_bytes=None):
    """A decoder-like step: each block saves ``per_block`` spans in its own forward slots;
    backward needs them in reverse order at twice the forward cost."""
    n = n_blocks * per_block
    compute = [fwd] * n + [fwd] + [2 * fwd] * n
    spans = [Span(nbytes, i, n + 1 + (n - 1 - i)) for i in range(n)]
    prof = Profile(compute, n, spans, bw, bw)
    sel_b = None if selective is None else int(selective * per_block * nbytes)
    sel_s = None if selective is None else selective * per_block * fwd
    blocks = [Block(b * per_block, (b + 1) * per_block, per_block * fwd,
                    input_bytes if input_bytes is not None else nbytes // 2, sel_b, sel_s)
              for b in range(n_blocks)]
    return prof, blocks


def test_apply_modes_full_block():
    prof, blocks = keep_view(n_blocks=2, per_block=3)
    view = apply_modes(prof, blocks, ("keep", "full"))
    n = prof.n_forward
    # Block 1's three spans became one input span saved at its first save slot ...
    assert len(view.spans) == 4
    inp = [sp for sp in view.spans if sp.save == 3]
    assert inp == [Span(MB // 2, 3, n + 1)]
    # ... needed where its backward begins, which now also recomputes its forward ...
    assert view.compute[n + 1] == pytest.approx(prof.compute[n + 1] + blocks[1].forward_seconds)
    # ... and the re-created activations are held through its backward.
    assert view.reserve[n + 1:n + 4] == (3 * MB,) * 3
    assert sum(view.reserve) == 9 * MB
    assert working_set(prof, blocks[1]) == 3 * MB


def test_apply_modes_selective_holds_what_it_keeps():
    prof, blocks = keep_view(n_blocks=2, per_block=2, selective=0.5)
    view = apply_modes(prof, blocks, ("selective", "keep"))
    n = prof.n_forward
    begin = n + 1 + 2       # block 0's spans are needed after block 1's two
    held = blocks[0].selective_bytes
    assert all(view.reserve[s] == held for s in range(0, begin))
    assert view.reserve[begin] == 2 * MB
    assert view.compute[begin] == pytest.approx(prof.compute[begin] + blocks[0].selective_seconds)


def test_apply_modes_rejects_bad_input():
    prof, blocks = keep_view(n_blocks=2)
    with pytest.raises(ValueError, match="modes has 1 entries"):
        apply_modes(prof, blocks, ("keep",))
    with pytest.raises(ValueError, match="one of"):
        apply_modes(prof, blocks, ("keep", "swap"))
    with pytest.raises(ValueError, match="no measured selective"):
        apply_modes(prof, blocks, ("keep", "selective"))


def test_ineligible_blocks_are_kept():
    prof, blocks = keep_view(n_blocks=2)
    blocks[1] = Block(3, 6, 3e-3, MB, eligible=False)
    assert full_recompute_modes(blocks) == ("full", "keep")
    assert apply_modes(prof, blocks, ("keep", "full")) == prof
    assert conversion_order(prof, blocks) == [0]


def test_nothing_changes_when_the_natural_peak_fits():
    prof, blocks = keep_view()
    hp = plan_hybrid(prof, blocks, unmoved_peak(prof))
    assert hp.modes == ("keep",) * 4 and not hp.swap.move
    assert hp.counts() == (4, 0, 0)
    assert plan_hybrid(prof, blocks, None).modes == ("keep",) * 4


def test_conversion_order_starts_with_the_last_blocks():
    prof, blocks = keep_view(n_blocks=4)
    assert conversion_order(prof, blocks) == [3, 2, 1, 0]


def test_a_slow_link_recomputes_and_a_fast_one_swaps():
    budget = unmoved_peak(keep_view()[0]) // 3
    slow, blocks = keep_view(bw=1e8)          # 1 MiB takes 10 ms against 1 ms of compute
    hp = plan_hybrid(slow, blocks, budget)
    assert "full" in hp.modes
    assert hp.predicted.budget_ok
    fast, blocks = keep_view(bw=1e13)
    hp = plan_hybrid(fast, blocks, budget)
    assert hp.modes == ("keep",) * 4 and hp.swap.move
    assert hp.predicted.stall_seconds == pytest.approx(0.0, abs=1e-9)


def test_selective_is_chosen_when_it_is_cheap_enough():
    prof, blocks = keep_view(bw=1e8, selective=0.25)
    budget = unmoved_peak(prof) // 2
    hp = plan_hybrid(prof, blocks, budget)
    assert hp.predicted.budget_ok
    assert "selective" in hp.modes


def _no_swap(view: Profile, budget: int):
    return simulate(view, Plan(frozenset()), budget)


@settings(max_examples=40, deadline=None)
@given(n_blocks=st.integers(1, 6), per_block=st.integers(1, 4),
       bw=st.sampled_from([1e7, 1e8, 1e9, 1e10, 1e12]),
       frac=st.floats(0.15, 0.95), sel=st.one_of(st.none(), st.floats(0.1, 0.9)),
       inp=st.integers(0, MB))
def test_never_slower_than_full_recompute_or_swap_alone(n_blocks, per_block, bw, frac, sel, inp):
    prof, blocks = keep_view(n_blocks, per_block, bw=bw, selective=sel, input_bytes=inp)
    budget = int(unmoved_peak(prof) * frac)
    hp = plan_hybrid(prof, blocks, budget)
    got = hp.predicted
    assert simulate(hp.profile, hp.swap, budget) == got       # the prediction is the plan's
    full = apply_modes(prof, blocks, full_recompute_modes(blocks))
    full_pred = _no_swap(full, budget)
    if full_pred.budget_ok and full_pred.forced_offloads == 0:
        # Full recomputation fits by itself: the hybrid plan fits and is never predicted slower.
        assert got.budget_ok
        assert got.total_seconds <= full_pred.total_seconds * (1 + 1e-9)
    swap_only = simulate(prof, Plan(frozenset()), budget)     # the guard's forced copies
    if got.budget_ok and swap_only.budget_ok:
        assert got.total_seconds <= swap_only.total_seconds * (1 + 1e-9)


@pytest.mark.parametrize("n, target", [(0, 0), (1, 1), (37, 0), (37, 23), (37, 37), (1000, 611)])
def test_best_count_finds_the_least_of_a_v(n, target):
    calls = []

    def score(k):
        calls.append(k)
        return (abs(k - target),)
    assert best_count(score, n) == target
    assert len(calls) == len(set(calls))            # each k scored once
    # A flat score: the smallest k.
    assert best_count(lambda k: (0,), n) == 0

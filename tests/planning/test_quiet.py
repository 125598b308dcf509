"""The quiet mix (planning/quiet.py): kept and fully recomputed blocks, nothing moved, found
without the swap search, for plans made from figures the engine does not trust yet."""
from __future__ import annotations

import itertools

from hypothesis import given, settings, strategies as st

from chameleon_swap.planning.modes import apply_modes, conversion_order, plan_hybrid, working_set
from chameleon_swap.planning.quiet import plan_quiet
from chameleon_swap.planning.timeline import Plan, simulate, unmoved_peak

from _traces import gpu_keep_view
from test_modes import MB, keep_view


def _quiet_best(prof, blocks, budget):
    """Brute force: the least predicted time of every keep/full mix that fits moving nothing."""
    best = None
    for modes in itertools.product(("keep", "full"), repeat=len(blocks)):
        view = apply_modes(prof, blocks, modes)
        if any(m == "full" and working_set(prof, b) > budget for b, m in zip(blocks, modes)):
            continue
        if unmoved_peak(view) > budget:
            continue
        t = simulate(view, Plan(frozenset()), budget).total_seconds
        best = t if best is None else min(best, t)
    return best


def test_a_step_that_fits_keeps_everything():
    prof, blocks = keep_view()
    qp = plan_quiet(prof, blocks, unmoved_peak(prof))
    assert qp.modes == ("keep",) * 4 and not qp.predicted.moved_bytes


def test_it_moves_nothing_and_fits_where_the_full_search_would_copy():
    fast, blocks = keep_view(bw=1e13)              # swapping hides: the full search keeps all
    budget = unmoved_peak(fast) // 2
    hp = plan_hybrid(fast, blocks, budget)
    assert hp.predicted.moved_bytes > 0
    qp = plan_quiet(fast, blocks, budget)
    assert "full" in qp.modes and "selective" not in qp.modes
    assert qp.predicted.moved_bytes == 0 and qp.predicted.budget_ok
    assert qp.predicted.forced_offloads == 0
    assert qp.profile == apply_modes(fast, blocks, qp.modes)
    assert qp.swap.predicted == simulate(qp.profile, Plan(frozenset()), budget)
    assert all((w > 0) == (m == "full") for w, m in zip(qp.working_set, qp.modes))
    # Never behind the fallback the full search carries where that moves nothing (the best
    # quiet mix it scored; a fallback may copy a few saves, calibration.light).
    if not hp.fallback.predicted.moved_bytes:
        assert qp.predicted.total_seconds <= hp.fallback.predicted.total_seconds * (1 + 1e-9)
    # The blocks it recomputes come first in the conversion order or in its reverse.
    order = conversion_order(fast, blocks)
    k = qp.modes.count("full")
    assert {b for b, m in enumerate(qp.modes) if m == "full"} in (set(order[:k]),
                                                                  set(order[::-1][:k]))


def test_none_when_even_recomputing_every_block_does_not_fit():
    prof, blocks = keep_view(input_bytes=MB)
    full = apply_modes(prof, blocks, ("full",) * 4)
    assert plan_quiet(prof, blocks, unmoved_peak(full) - 1) is None


@settings(max_examples=40, deadline=None)
@given(n_blocks=st.integers(1, 5), per_block=st.integers(1, 4),
       frac=st.floats(0.1, 0.95), inp=st.integers(0, MB), fwd=st.floats(1e-4, 1e-2))
def test_as_fast_as_any_quiet_mix_along_the_order_and_never_slower_than_all_full(
        n_blocks, per_block, frac, inp, fwd):
    prof, blocks = keep_view(n_blocks, per_block, fwd=fwd, input_bytes=inp)
    budget = int(unmoved_peak(prof) * frac)
    qp = plan_quiet(prof, blocks, budget)
    brute = _quiet_best(prof, blocks, budget)
    if qp is None:
        assert brute is None
        return
    assert qp.predicted.budget_ok and qp.predicted.moved_bytes == 0
    # On these views time grows with every block recomputed, and a block recomputed earlier in
    # forward frees more of the peak: the best of all quiet mixes is a prefix of one order.
    assert qp.predicted.total_seconds <= brute * (1 + 1e-9)


def test_on_the_gpu_traces_it_recomputes_the_least_that_fits():
    # The engine's own H100 trace of HF Llama 4096x8 at 16k tokens: every block recomputed
    # still holds 28% of the natural peak (its inputs, the embedding and the head), so at 25%
    # no mix fits without copies and only the full search can plan it.
    prof, blocks = gpu_keep_view("h4096-unreached-16384")
    assert plan_quiet(prof, blocks, int(unmoved_peak(prof) * 0.25)) is None
    for frac in (0.3, 0.5, 0.75):
        budget = int(unmoved_peak(prof) * frac)
        qp = plan_quiet(prof, blocks, budget)
        assert qp is not None and qp.predicted.budget_ok and not qp.predicted.moved_bytes
        k = qp.modes.count("full")
        assert k == 0 or unmoved_peak(apply_modes(prof, blocks, _fewer(qp.modes, prof, blocks))) \
            > budget


def _fewer(modes, prof, blocks):
    """``modes`` with the last block it recomputes in the conversion order kept instead."""
    order = [b for b in conversion_order(prof, blocks) if modes[b] == "full"]
    out = list(modes)
    out[order[-1]] = "keep"
    return tuple(out)

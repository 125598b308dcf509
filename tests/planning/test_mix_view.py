"""A mix's timeline and which keep-view span each of its spans is (no torch)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from chameleon_swap.planning.mix_view import MODES, apply_modes, own_spans, span_origins
from chameleon_swap.planning.modes import plan_hybrid
from _traces import gpu_keep_view
from _traces import keep_view


def _check_origins(prof, blocks, modes):
    view = apply_modes(prof, blocks, modes)
    origins = span_origins(prof, blocks, modes)
    assert len(origins) == len(view.spans)
    dropped = set()
    inputs = []
    for blk, m in zip(blocks, modes):
        if m != "keep" and blk.eligible and blk.first_span < blk.end_span:
            own, begin = own_spans(prof, blk)
            if begin < prof.n_slots:
                dropped.update(own)
                inputs.append(blk.input_bytes)
    # Every kept span is the keep view's own, once and in save order; the others are inputs.
    kept = [j for j in origins if j >= 0]
    assert kept == sorted(set(range(len(prof.spans))) - dropped)
    for sp, j in zip(view.spans, origins):
        if j >= 0:
            assert sp == prof.spans[j]
    assert sorted(sp.nbytes for sp, j in zip(view.spans, origins) if j < 0) == sorted(inputs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(MODES), min_size=4, max_size=4), st.integers(1, 4))
def test_origins_name_each_kept_span_and_mark_the_inputs(modes, per_block):
    prof, blocks = keep_view(n_blocks=4, per_block=per_block, selective=0.5)
    _check_origins(prof, blocks, tuple(modes))


def test_origins_on_the_h100_trace_and_in_the_plans_made():
    prof, blocks = gpu_keep_view("h4096-unreached-16384")
    for modes in (("keep",) * 8, ("full",) * 8, ("keep", "full") * 4,
                  ("full",) * 3 + ("keep",) * 5):
        _check_origins(prof, blocks, modes)
    budget = int(sum(sp.nbytes for sp in prof.spans) * 0.25)
    hp = plan_hybrid(prof, blocks, budget)
    assert hp.origins == span_origins(prof, blocks, hp.modes)
    assert len(hp.origins) == len(hp.profile.spans)

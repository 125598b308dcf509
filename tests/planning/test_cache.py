"""Plans compiled for the runtime (planning/cache.py): a mix's swap set as a plan by keys."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from chameleon_swap.planning.cache import compile_mix
from chameleon_swap.planning.mix_view import MODES
from chameleon_swap.planning.modes import _made, apply_modes
from chameleon_swap.planning.signatures import TensorKey
from chameleon_swap.planning.swaps import plan as plan_swaps
from _traces import keep_view


def _keys(n):
    return tuple(TensorKey(7, 0, i, "float32", (2, 16 + i)) for i in range(n))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(MODES), min_size=4, max_size=4), st.sampled_from([0.2, 0.4, 0.7]),
       st.sampled_from([1e8, 1e9, 1e10]))
def test_a_mix_plan_moves_its_kept_spans_by_key_and_fetches_no_later_than_planned(modes, frac,
                                                                                  bw):
    prof, blocks = keep_view(n_blocks=4, per_block=3, selective=0.5)
    prof = type(prof)(prof.compute, prof.n_forward, prof.spans, bw, bw)
    view = apply_modes(prof, blocks, tuple(modes))
    budget = int(sum(sp.nbytes for sp in prof.spans) * frac)
    hp = _made(view, blocks, tuple(modes), plan_swaps(view, budget), prof)
    keys = _keys(len(prof.spans))
    e = compile_mix(hp.profile, hp.swap, hp.origins, keys, "mix:test", step=3)
    assert e.by_mix and e.ids == [] and e.made_at == 3
    assert len(e.keys) == len(e.move) == len(e.nbytes) == len(view.spans)
    for j, o in enumerate(hp.origins):
        if o >= 0:                     # the keep view's tensor: its key, moved as planned
            assert e.keys[j] == keys[o] and e.index.find(keys[o]) == j
            assert e.move[j] == (j in hp.swap.move)
        else:                          # a recomputed block's input: no key finds it
            assert e.keys[j] not in keys and not e.move[j]
    issued = list(e.at_forward_end) + [j for js in e.triggers.values() for j in js]
    assert sorted(issued) == [j for j in range(len(view.spans)) if e.move[j]]
    n_slots = len(view.compute)
    found = sorted(sp.use for sp, o in zip(view.spans, hp.origins) if o >= 0 and sp.use < n_slots)
    for k, js in e.triggers.items():
        assert hp.origins[k] >= 0                # fired by a tensor the runtime can find
        for j in js:                             # at the latest such use by the plan's slot
            slot = hp.swap.fetch_at[j]
            assert view.spans[k].use <= slot
            assert not [u for u in found if view.spans[k].use < u <= slot]
    for j in e.at_forward_end:                   # none is used before its slot
        assert not [u for u in found if u <= hp.swap.fetch_at.get(j, 0)]
    assert e.moved_bytes == sum(view.spans[j].nbytes for j in hp.swap.move)
    assert e.budget_bytes == budget

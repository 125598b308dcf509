"""timeline_run.py: the pieces of timeline.simulate. The whole is compared with the pre-split
implementation in tests/planning/test_timeline.py; here the tree of pending copies back is checked against
a plain list on random put / clear / take sequences."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_swap.planning.timeline_run import INF, PendingCopies


@st.composite
def tree_ops(draw):
    n_slots = draw(st.integers(1, 12))
    n = draw(st.integers(1, 20))
    use = [draw(st.integers(0, n_slots)) for _ in range(n)]
    fslot = {k: draw(st.integers(0, use[k])) for k in draw(st.sets(st.integers(0, n - 1),
                                                                     min_size=1))}
    ops = draw(st.lists(st.tuples(st.sampled_from(["put", "clear", "take"]),
                                  st.sampled_from(sorted(fslot)), st.integers(0, 9)),
                        max_size=60))
    return fslot, use, n_slots, ops


@settings(max_examples=300, deadline=None)
@given(tree_ops())
def test_pending_copies_first_fit_matches_a_plain_scan(case):
    fslot, use, n_slots, ops = case
    pc = PendingCopies(fslot, use, n_slots)
    order = sorted(fslot, key=lambda k: (fslot[k], use[k], k))
    assert pc.order == order                              # issue order: fetch slot, use, index
    for s in range(n_slots + 1):
        assert pc.buckets[s] == ([k for k in order if fslot[k] == s] or None)
    held: dict[int, int] = {}                             # the plain model: span -> size
    for op, k, v in ops:
        if op == "put":
            if k not in held:                             # a copy is put once until taken
                pc.put(k, v)
                held[k] = v
        elif op == "clear":
            if k in held:
                pc.clear(k)
                del held[k]
        else:
            room = v
            fits = [j for j in order if j in held and held[j] <= room]
            if fits:
                assert pc.take(room) == fits[0]
                del held[fits[0]]
        assert pc.tree[1] == min(held.values(), default=INF)
        assert all(pc.holds(j) == (j in held) for j in fslot)

"""What mixes ran at (policy/mix_runs.py): step times per size and mix, their median."""
from __future__ import annotations

from types import SimpleNamespace

from chameleon_swap.policy.mix_runs import RUNS_KEPT, MixRuns


def calls(*modes):
    # First calls of blocks 0, 1, ... in call order (the mix is kept sorted by block).
    return [SimpleNamespace(block=b, mode=m) for b, m in reversed(list(enumerate(modes)))]


def test_a_mix_keeps_its_last_step_times_and_is_read_by_their_median():
    runs = MixRuns()
    for t in (5.0, 1.0, 2.0, 3.0):
        mix, seen = runs.add(7, calls("keep", "full"), t)
    assert mix == ((0, "keep"), (1, "full"))
    assert seen == [1.0, 2.0, 3.0] and len(seen) == RUNS_KEPT      # the first left
    runs.add(7, calls("full", "full"), 4.0)
    assert runs.measured(7, [0, 1]) == {("keep", "full"): 2.0, ("full", "full"): 4.0}
    assert runs.measured(7, [1, 0]) == {("full", "keep"): 2.0, ("full", "full"): 4.0}


def test_other_sizes_and_other_blocks_are_not_this_sizes_mixes():
    runs = MixRuns()
    runs.add(7, calls("keep", "full"), 1.0)
    runs.add(8, calls("full", "full"), 2.0)
    runs.add(7, calls("keep", "full", "full"), 3.0)     # a third block called: another model
    assert runs.measured(7, [0, 1]) == {("keep", "full"): 1.0}
    assert runs.measured(9, [0, 1]) == {}

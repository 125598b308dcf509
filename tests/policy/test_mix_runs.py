"""What mixes ran at (policy/mix_runs.py): step times per size and mix, their median."""
from __future__ import annotations

from types import SimpleNamespace

from chameleon_swap.policy.mix_runs import RUNS_KEPT, MixRuns


def calls(*modes):
    # First calls of blocks 0, 1, ... in call order (the mix is kept sorted by block).
    return [SimpleNamespace(block=b, mode=m) for b, m in reversed(list(enumerate(modes)))]


def test_a_mix_keeps_its_last_step_times_and_is_read_by_their_median():
    runs = MixRuns()
    mix, seen, n = runs.add(7, calls("keep", "full"), 9.0)
    assert seen == [9.0] and n == 1                  # its first step stands in, until ...
    mix, seen, n = runs.add(7, calls("keep", "full"), 5.0)
    assert seen == [5.0] and n == 2                  # ... the second replaces it
    for t in (1.0, 2.0, 3.0):
        mix, seen, n = runs.add(7, calls("keep", "full"), t)
    assert mix == ((0, "keep"), (1, "full")) and n == 5
    assert seen == [1.0, 2.0, 3.0] and len(seen) == RUNS_KEPT      # the oldest left
    runs.add(7, calls("full", "full"), 4.0)
    assert runs.measured(7, [0, 1]) == {("keep", "full"): 2.0, ("full", "full"): 4.0}
    assert runs.measured(7, [1, 0]) == {("full", "keep"): 2.0, ("full", "full"): 4.0}


def test_of_two_step_times_the_faster_ranks_the_mix():
    # Noise only slows a step: the mean of 139 and 202 ms would rank the mix at 170.
    runs = MixRuns()
    for t in (0.5, 0.139, 0.202):
        runs.add(7, calls("keep", "keep"), t)
    assert runs.measured(7, [0, 1]) == {("keep", "keep"): 0.139}
    runs.add(7, calls("keep", "keep"), 0.150)          # three: their median
    assert runs.measured(7, [0, 1]) == {("keep", "keep"): 0.150}


def test_a_first_step_faster_than_the_second_stays_and_ranks_the_mix():
    # The first step stands in only where it was the slower: a second step that a wait slowed
    # (216 ms, then 349 ms) leaves the faster first to rank the mix.
    runs = MixRuns()
    runs.add(7, calls("keep", "full"), 0.216)
    mix, seen, n = runs.add(7, calls("keep", "full"), 0.349)
    assert seen == [0.216, 0.349] and n == 2
    assert runs.measured(7, [0, 1]) == {("keep", "full"): 0.216}
    runs.add(7, calls("keep", "full"), 0.220)                  # three: their median
    assert runs.measured(7, [0, 1]) == {("keep", "full"): 0.220}


def test_other_sizes_and_other_blocks_are_not_this_sizes_mixes():
    runs = MixRuns()
    runs.add(7, calls("keep", "full"), 1.0)
    runs.add(8, calls("full", "full"), 2.0)
    runs.add(7, calls("keep", "full", "full"), 3.0)     # a third block called: another model
    assert runs.measured(7, [0, 1]) == {("keep", "full"): 1.0}
    assert runs.measured(9, [0, 1]) == {}


def test_a_mix_holds_a_budget_its_kept_runs_all_ran_under_or_a_larger_one():
    # A mix that ran is read as fitting the budget it ran under (planning/modes.py's ``held``),
    # not a smaller one: the guard held it to that budget, not to this one. Its kept times rank
    # it, so their budgets decide.
    runs = MixRuns()
    runs.add(7, calls("keep", "keep"), 1.0, budget=100)
    runs.add(7, calls("keep", "full"), 1.0, budget=80)
    runs.add(7, calls("full", "full"), 1.0)                    # (no budget told: never held)
    assert runs.held(7, [0, 1], 100) == {("keep", "keep"), ("keep", "full")}
    assert runs.held(7, [0, 1], 90) == {("keep", "full")}
    for _ in range(RUNS_KEPT):                                 # its kept runs now under 60
        runs.add(7, calls("keep", "keep"), 1.0, budget=60)
    assert runs.held(7, [0, 1], 70) == {("keep", "keep")}
    runs.add(7, calls("keep", "keep"), 1.0, budget=100)        # one kept run under 100 again
    assert runs.held(7, [0, 1], 70) == set()
    assert runs.held(8, [0, 1], 100) == set()

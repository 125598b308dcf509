"""What mixes ran at (policy/mix_runs.py): step times per size and mix, the last two read."""
from __future__ import annotations

from types import SimpleNamespace

from chameleon_swap.policy.mix_runs import RUNS_KEPT, MixRuns

from _helpers import shared_cpu_noise


def calls(*modes):
    # First calls of blocks 0, 1, ... in call order (the mix is kept sorted by block).
    return [SimpleNamespace(block=b, mode=m) for b, m in reversed(list(enumerate(modes)))]


def test_a_mix_keeps_its_last_step_times_and_is_read_by_the_faster_of_the_last_two():
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
    runs.add(7, calls("keep", "keep"), 0.150)          # three: the faster of the last two
    assert runs.measured(7, [0, 1]) == {("keep", "keep"): 0.150}


def test_a_first_step_faster_than_the_second_stays_and_ranks_the_mix():
    # The first step stands in only where it was the slower: a second step that a wait slowed
    # (216 ms, then 349 ms) leaves the faster first to rank the mix.
    runs = MixRuns()
    runs.add(7, calls("keep", "full"), 0.216)
    mix, seen, n = runs.add(7, calls("keep", "full"), 0.349)
    assert seen == [0.216, 0.349] and n == 2
    assert runs.measured(7, [0, 1]) == {("keep", "full"): 0.216}
    runs.add(7, calls("keep", "full"), 0.220)                  # three: the faster of the last two
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


def test_a_mix_that_ran_three_steps_is_read_as_one_that_ran_two():
    # Step times 1.15, 1.0, 1.12 s: the middle of three (1.12) put a mix that ran two steps at
    # 1.0 and 1.1 s 11% ahead of it, past the 10% a switch asks; the faster of the last two
    # reads both at 1.0 s.
    runs = MixRuns()
    for t in (2.0, 1.15, 1.0, 1.12):                   # (the first stands in)
        runs.add(7, calls("keep", "full"), t)
    for t in (1.0, 1.1):
        runs.add(7, calls("full", "full"), t)
    assert runs.measured(7, [0, 1]) == {("keep", "full"): 1.0, ("full", "full"): 1.0}


def test_two_mixes_as_fast_are_seldom_ranked_apart_by_noise():
    # Through MixRuns itself: two mixes exactly as fast, one with three kept steps (a mix the size
    # ran), one with two (a fallback after its trial), every step its time x (1 + |N(0, 0.12)|),
    # one in five 10-50% slower instead (a shared CPU's noise only slows a step). How often the
    # second reads 10% ahead of the first (the gain a switch asks for): 46 of 400 with the
    # faster of the last two for both; with the middle of three against the faster of two, 87.
    noise = shared_cpu_noise()
    apart = 0
    for _ in range(400):
        runs = MixRuns()
        for i in range(4):
            runs.add(7, calls("keep", "full"), 3.0 if i == 0 else noise())
        for _ in range(2):
            runs.add(7, calls("full", "full"), noise())
        got = runs.measured(7, [0, 1])
        apart += got[("full", "full")] < 0.9 * got[("keep", "full")]
    assert apart <= 0.15 * 400, apart

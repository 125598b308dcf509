"""best_count: the least of a roughly unimodal score over a count (no torch)."""
from __future__ import annotations

import pytest

from chameleon_swap.planning.ladder import best_count


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

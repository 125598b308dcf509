"""The environment facts every benchmark result carries (``bench/env.py``)."""
from __future__ import annotations

import torch

from chameleon_swap.bench.env import delay_note, environment
from chameleon_swap.copy.host_pool import ALLOC_DELAY_ENV


def test_a_result_says_when_the_host_arenas_testing_delay_was_on(monkeypatch):
    """Results run with host allocations slowed on purpose (as pinning is on CUDA) say so, in
    their JSON and in their header; results run without it carry no such field."""
    monkeypatch.delenv(ALLOC_DELAY_ENV, raising=False)
    plain = environment(torch.device("cpu"))
    assert "host_alloc_delay_s_per_gib" not in plain and delay_note(plain) == ""
    assert {"device", "torch", "commit", "date"} <= set(plain)
    monkeypatch.setenv(ALLOC_DELAY_ENV, "400")
    slowed = environment(torch.device("cpu"))
    assert slowed["host_alloc_delay_s_per_gib"] == 400.0
    assert "400 s a GiB" in delay_note(slowed) and "testing delay" in delay_note(slowed)
    monkeypatch.setenv(ALLOC_DELAY_ENV, "0")
    assert "host_alloc_delay_s_per_gib" not in environment(torch.device("cpu"))

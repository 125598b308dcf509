"""A copy-out the budget does not need yet never waits for host memory (issue 19, item 1: "a
step that would have waited moves less or recomputes; it does not stall"). With no host buffer
ready (``HostPool.ready``) such a copy-out is put off (``StepStats.host_deferred_moves``): the
tensor stays resident and is moved at a later save, once a buffer is ready or the budget needs
its bytes. Tested on the CPU with the allocator slowed on purpose (the testing hook): losses and
gradients stay bitwise the plain run's and the budget is never passed."""
from __future__ import annotations

import pytest
import torch

from chameleon_swap.copy import host_pool

from _helpers import compare

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class _Wide(torch.nn.Module):
    """Elementwise layers over rows of 256 floats: 1 KiB saved per row and layer."""

    def __init__(self, layers: int = 8) -> None:
        super().__init__()
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.full((256,), 1.0 + i / 10))
                                        for i in range(layers))

    def forward(self, x):
        for w in self.w:
            x = torch.tanh(x * w)
        return x.sum()


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 256, generator=torch.Generator().manual_seed(seed))


def _run(budget_of, rows, *, between=None, **kwargs):
    """Plain and engine runs side by side (``compare``), the budget ``budget_of`` the batches'
    natural peaks; after every step nothing stays resident and the totals count every put-off
    copy. Returns the history and the budget."""
    def check(eng):
        assert eng.resident_bytes == 0
        assert eng.totals.host_deferred_moves == sum(s.host_deferred_moves for s in eng.history)
        if between is not None:
            between(eng)
    hist, _, budget = compare(_Wide(), [_rows(n, seed=i) for i, n in enumerate(rows)], budget_of,
                              between=check, **kwargs)
    return hist, budget


@pytest.mark.parametrize("policy", ["guard", "chameleon"])
def test_copy_outs_the_budget_does_not_need_never_wait_for_host_memory(monkeypatch, policy):
    """A budget the steps never pass (the largest natural peak): every copy-out is one the policy starts
    early (room for one more tensor of the largest size) and none is needed yet. On a cold
    arena and a slow allocator the first step puts them off instead of allocating on its own
    thread; no step waits for host memory, and once the arena has grown (off the step) they run."""
    monkeypatch.setenv(host_pool.ALLOC_DELAY_ENV, "2")          # 2 s per GiB
    hist, budget = _run(max, [2048, 1024, 2048, 1536, 2048],
                        between=lambda eng: eng._pool.wait_ahead(timeout=60), policy=policy)
    assert hist[0].host_deferred_moves > 0, hist[0]
    assert all(s.host_wait_seconds == 0 and s.forced_offloads == 0 for s in hist), hist
    if policy == "guard":        # (chameleon's plans move nothing at a budget that fits)
        assert sum(s.offloaded_tensors for s in hist[1:]) > 0   # moved once buffers were ready


@pytest.mark.parametrize("policy", ["guard", "chameleon", "static"])
@pytest.mark.parametrize("fraction", [0.3, 0.6])
def test_put_off_copy_outs_go_when_the_budget_needs_them(monkeypatch, policy, fraction):
    """A budget below the natural peak with a slow allocator: copy-outs put off early are made
    when the budget needs their bytes (waiting then for host memory), and the budget holds."""
    monkeypatch.setenv(host_pool.ALLOC_DELAY_ENV, "2")
    hist, _ = _run(lambda peaks: int(min(peaks) * fraction), [1024, 2048, 1536, 2048], policy=policy)
    assert hist[0].host_deferred_moves > 0, hist[0]
    assert all(s.offloaded_tensors > 0 for s in hist)


@pytest.mark.parametrize("policy", ["guard", "chameleon"])
def test_with_no_buffer_ever_ready_only_what_the_budget_needs_moves(monkeypatch, policy):
    """Deterministic: ``ready`` always says no. Every copy-out a policy starts early is put off;
    those the budget needs are still made (the budget holds, gradients bitwise)."""
    monkeypatch.setattr(host_pool.HostPool, "ready", lambda self, nbytes: False)
    hist, budget = _run(lambda peaks: int(min(peaks) * 0.5), [1024, 2048, 1024])
    for s in hist:
        assert s.host_deferred_moves > 0 and s.offloaded_tensors > 0, s

"""chameleon_swap.integrations (the shared part): frameworks are imported only by their own
submodule, a step held open across two events is released as failed on an exception, and the
logged figures summarise the steps since the last log."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import chameleon_swap as cs
from chameleon_swap.integrations._common import StepSpan, figures, make_engine

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def test_importing_the_package_imports_no_framework():
    code = ("import sys, chameleon_swap, chameleon_swap.integrations; "
            "chameleon_swap.Chameleon; "
            "print(sorted(m for m in ('transformers', 'lightning', 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _step(model, x):
    (model(x) ** 2).sum().backward()


def test_span_closes_normally_and_as_failed():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    x = torch.randn(32, 64)
    with make_engine({"budget": 4096, "min_tensor_bytes": 0}, device="cpu") as eng:
        span = StepSpan()
        span.open(eng)
        with pytest.raises(RuntimeError, match="already open"):
            span.open(eng)
        _step(model, x)
        assert span.close() and not span.close()      # closing twice is a no-op
        span.open(eng)
        model(x)                                       # forward only, then an exception
        assert span.close(ValueError("boom"))
        assert [s.failed for s in eng.history] == [False, True]
        assert eng.history[0].offloaded_bytes > 0
        assert eng.host_bytes_in_use == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_figures_sum_moves_and_take_the_largest_peak():
    a = cs.StepStats(step=0, budget_bytes=100, peak_resident_bytes=90, saved_bytes=300,
                     offloaded_bytes=200, offloaded_tensors=2, prefetched_bytes=150,
                     fetched_bytes=50, sync_fetches=1, late_prefetches=0, budget_waits=0,
                     stall_seconds=0.5, step_seconds=2.0, host_peak_bytes=200, skipped_bytes=0)
    b = cs.StepStats(**{**a.as_dict(), "step": 1, "peak_resident_bytes": 95, "sync_fetches": 3})
    f = figures([a, b])
    assert f == {"chameleon/steps": 2.0, "chameleon/peak_resident_bytes": 95.0,
                 "chameleon/offloaded_bytes": 400.0, "chameleon/moved_back_bytes": 400.0,
                 "chameleon/sync_fetches": 4.0, "chameleon/stall_seconds": 1.0,
                 "chameleon/step_seconds": 4.0, "chameleon/budget_bytes": 100.0}
    assert figures([]) == {}
    assert "chameleon/budget_bytes" not in figures([cs.StepStats(**{**a.as_dict(),
                                                                     "budget_bytes": None})])

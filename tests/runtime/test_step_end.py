"""The step's end: the policy plans with Python's cyclic garbage collector paused, and the
collector's state is put back as it was; its time is reported apart from the step's
(``runtime/step_end.py``)."""
from __future__ import annotations

import gc
import time

import pytest

import chameleon_swap as cs
from chameleon_swap.policy.chameleon import ChameleonPolicy

from _helpers import natural_peak, train_step
from _models import lm_batches, tiny_llama


@pytest.fixture
def eager_collector():
    """Young collections every few allocations, so that any planning that runs with the collector
    on meets some; thresholds and state put back after the test."""
    thresholds, was = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(20, 2, 1000)
    gc.enable()
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        (gc.enable if was else gc.disable)()


def _watch_planning(monkeypatch) -> dict:
    """Counts young collections that run inside the policy's end of step, and its calls."""
    seen = {"planning": False, "collections": 0, "calls": 0, "enabled_after": []}
    real = ChameleonPolicy.end_step

    def end_step(self, *args, **kwargs):
        seen["planning"], seen["calls"] = True, seen["calls"] + 1
        try:
            return real(self, *args, **kwargs)
        finally:
            seen["planning"] = False

    def callback(phase, info):
        if phase == "start" and seen["planning"]:
            seen["collections"] += 1
    monkeypatch.setattr(ChameleonPolicy, "end_step", end_step)
    gc.callbacks.append(callback)
    return seen


def _steps(monkeypatch, n: int = 4, disable: bool = False) -> dict:
    model = tiny_llama(n_layers=3)
    batches = lm_batches(model, [24, 32, 24, 40][:n])
    budget = natural_peak(model, batches[0]) // 3
    seen = _watch_planning(monkeypatch)
    if disable:
        gc.disable()
    try:
        _run(model, batches, budget, seen)
    finally:
        gc.callbacks.pop()
    return seen


def _run(model, batches, budget: int, seen: dict) -> None:
    with cs.Chameleon(budget, model=model, min_tensor_bytes=0) as eng:
        for b in batches:
            train_step(model, b, eng)
            seen["enabled_after"].append(gc.isenabled())
        assert any(s.plan_source in ("planned", "replanned") for s in eng.history)


def test_the_policy_plans_with_the_cyclic_collector_paused(eager_collector, monkeypatch):
    seen = _steps(monkeypatch)
    assert seen["calls"] == 4
    # With collections every 20 allocations, a single plan made with the collector on meets
    # dozens (checked: 1,083 over these four steps without the pause).
    assert seen["collections"] == 0
    assert seen["enabled_after"] == [True] * 4


def test_a_collector_the_user_disabled_stays_disabled(eager_collector, monkeypatch):
    seen = _steps(monkeypatch, 2, disable=True)
    assert seen["enabled_after"] == [False, False]


def test_the_collector_comes_back_when_planning_raises(eager_collector, monkeypatch):
    def boom(self, *args, **kwargs):
        assert not gc.isenabled()
        raise RuntimeError("planning failed")
    model = tiny_llama(n_layers=2)
    (batch,) = lm_batches(model, [16])
    budget = natural_peak(model, batch) // 2
    monkeypatch.setattr(ChameleonPolicy, "end_step", boom)
    with cs.Chameleon(budget, model=model, min_tensor_bytes=0) as eng:
        with pytest.raises(RuntimeError, match="planning failed"):
            train_step(model, batch, eng)
    assert gc.isenabled()


def test_planning_is_reported_apart_from_the_step(monkeypatch):
    """``StepStats.planning_seconds``: the policy's end of step on the real clock, outside
    ``host_seconds`` (two disjoint intervals inside the wall time around the step), summed in
    the totals and shown in the step's line."""
    real = ChameleonPolicy.end_step

    def slow(self, *args, **kwargs):
        time.sleep(0.3)                      # a plan that takes 0.3 s at least
        return real(self, *args, **kwargs)
    monkeypatch.setattr(ChameleonPolicy, "end_step", slow)
    model = tiny_llama(n_layers=2)
    batches = lm_batches(model, [16, 24])
    budget = natural_peak(model, batches[0]) // 2
    walls = []
    with cs.Chameleon(budget, model=model, min_tensor_bytes=0) as eng:
        for b in batches:
            t0 = time.perf_counter()
            train_step(model, b, eng)
            walls.append(time.perf_counter() - t0)
    assert len(eng.history) == 2
    for st, wall in zip(eng.history, walls):
        assert st.planning_seconds >= 0.3
        assert st.host_seconds + st.planning_seconds <= wall
        assert st.step_seconds == st.host_seconds          # the CPU: the step without its end
        assert "planning " in str(st)
    assert eng.totals.planning_seconds == sum(s.planning_seconds for s in eng.history)


def test_the_planner_contends_only_where_no_core_is_spare(monkeypatch):
    """``planner_busy_seconds``: how long the planner process had jobs since the step began
    (``Worker.busy_seconds``), where the step's own threads plus the planner's need more cores
    than there are (on the CPU: torch's compute threads and a copy worker; on a device, the
    thread that launches its kernels); else 0. ``checks.slowed`` reads it against the step."""
    from types import SimpleNamespace as NS

    import torch

    from chameleon_swap.policy import checks
    from chameleon_swap.runtime import step_end

    def worker(busy, broken=None):
        return NS(busy_seconds=lambda since: busy, broken=broken)

    def eng(w, device="cpu"):
        return NS(_policy=NS(modes=NS(worker=w)), device=torch.device(device))
    assert step_end._cores() >= 1                                  # the machine's own
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(step_end, "_cores", lambda: 2)
    busy = worker(0.2)
    assert step_end.planner_busy_seconds(eng(busy), 0.0) == 0.2       # 1 + copy + planner > 2
    assert step_end.planner_busy_seconds(eng(worker(0.2, "closed")), 0.0) == 0.0
    assert step_end.planner_busy_seconds(eng(None), 0.0) == 0.0       # plans made in the step
    assert step_end.planner_busy_seconds(NS(_policy=NS(), device=torch.device("cpu")), 0.0) == 0
    assert step_end.planner_busy_seconds(eng(busy, "meta"), 0.0) == 0.0   # a device's: 1 + 1
    monkeypatch.setattr(step_end, "_cores", lambda: 3)
    assert step_end.planner_busy_seconds(eng(busy), 0.0) == 0.0
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert step_end.planner_busy_seconds(eng(busy), 0.0) == 0.2
    # Read against the step: more than a tenth of it is slowed.
    for seconds, slowed in ((0.11, True), (0.09, False), (0.0, False)):
        profile = NS(step_seconds=1.0, extra={"planner_seconds": seconds})
        assert checks.contended(profile) is slowed
    assert not checks.contended(NS(step_seconds=None, extra={"planner_seconds": 1.0}))

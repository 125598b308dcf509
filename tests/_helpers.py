"""Shared test helpers: run the same code with and without the engine and compare bit for bit."""
from __future__ import annotations

import copy
from typing import Callable, Optional

import torch

import chameleon_swap as cs


def grads(model: torch.nn.Module) -> dict:
    return {n: (None if p.grad is None else p.grad.detach().clone())
            for n, p in model.named_parameters()}


def train_step(model: torch.nn.Module, batch, eng: Optional[cs.Chameleon] = None,
               loss_fn: Optional[Callable] = None) -> torch.Tensor:
    """One forward+backward; inside ``eng.step()`` when an engine is given. Returns the loss."""
    loss_fn = loss_fn or (lambda m, b: m(*b) if isinstance(b, tuple) else m(b))
    if eng is None:
        loss = loss_fn(model, batch)
        loss.backward()
    else:
        with eng.step():
            loss = loss_fn(model, batch)
            loss.backward()
    return loss.detach()


def assert_bitwise(ref_loss, ref_grads, loss, got_grads) -> None:
    assert torch.equal(ref_loss, loss), f"loss differs: {ref_loss.item()} vs {loss.item()}"
    assert ref_grads.keys() == got_grads.keys()
    for name in ref_grads:
        a, b = ref_grads[name], got_grads[name]
        assert (a is None) == (b is None), f"grad presence differs for {name}"
        if a is not None:
            assert torch.equal(a, b), f"gradient of {name} differs (max abs diff {(a - b).abs().max()})"


def train_beside(model: torch.nn.Module, ref: torch.nn.Module, batches, eng: cs.Chameleon,
                 budget: int) -> None:
    """Each of ``batches`` trained on ``model`` under ``eng`` and on ``ref`` without it: every
    loss and gradient bit for bit, every step within ``budget``, nothing left resident or held
    on the host after it."""
    for b in batches:
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss = train_step(model, b, eng)
        assert_bitwise(train_step(ref, b), grads(ref), loss, grads(model))
        assert eng.last_step.peak_resident_bytes <= budget, eng.last_step
        assert eng.resident_bytes == 0 and eng.host_bytes_in_use == 0


def natural_peak(model: torch.nn.Module, batch, loss_fn=None, device="cpu") -> int:
    """Saved-activation peak of one step with no budget (everything counted, nothing moved)."""
    m = copy.deepcopy(model)
    with cs.Chameleon(None, device=device, min_tensor_bytes=0) as eng:
        train_step(m, batch, eng, loss_fn)
        return eng.last_step.peak_resident_bytes


def compare(model: torch.nn.Module, batches, budget_fraction, *, loss_fn=None, device="cpu",
            min_tensor_bytes=0, model_kwarg=False, between=None, **engine_kwargs):
    """Train a copy of ``model`` on ``batches`` without and with the engine (budget a fraction of
    the smallest batch's natural peak, a callable of the batches' natural peaks giving it, or None
    for unlimited); assert bitwise equality of every loss and gradient and that every step holds
    its budget. ``model_kwarg``: give the engine the trained copy as ``model=``
    (recomputation). ``between(engine)``: called after each step's checks. Returns the engine's
    history, the natural peaks and the budget."""
    ref, test = copy.deepcopy(model), copy.deepcopy(model)
    if model_kwarg:
        engine_kwargs["model"] = test
    peaks = [natural_peak(model, b, loss_fn, device) for b in batches]
    budget = (None if budget_fraction is None else budget_fraction(peaks)
              if callable(budget_fraction) else int(min(peaks) * budget_fraction))
    with cs.Chameleon(budget, device=device, min_tensor_bytes=min_tensor_bytes,
                      **engine_kwargs) as eng:
        for b in batches:
            ref.zero_grad(set_to_none=True)
            test.zero_grad(set_to_none=True)
            l_ref = train_step(ref, b, None, loss_fn)
            l = train_step(test, b, eng, loss_fn)
            assert_bitwise(l_ref, grads(ref), l, grads(test))
            st = eng.last_step
            if budget is not None:
                assert st.peak_resident_bytes <= budget, st
            assert eng.host_bytes_in_use == 0, "host buffers still held after the step"
            if between is not None:
                between(eng)
        return list(eng.history), peaks, budget


def steady_planning(monkeypatch, tick: float = 50e-6) -> None:
    """Every profiler and runner timestamp ``tick`` after the previous one, and nothing the mode
    and swap plans learn from the wall clock: the plans then depend on the bytes and the link
    alone. Each input switched off here has tests of its own on the real clock (the emulated
    link); a steady mock of the profiler's clock cannot make the steps' wall time steady."""
    from chameleon_swap.copy import cpu as cpu_copy
    from chameleon_swap.policy import block_modes, checks, keep_views, mix_runs
    from chameleon_swap.runtime import profiler
    ticks = iter(range(10**9))
    monkeypatch.setattr(profiler._CpuClock, "mark", lambda self: next(ticks) * tick)
    # The closed loop (policy/checks.py) compares plans with the step's wall time: it would
    # "correct" the mocked compute back to the machine's.
    monkeypatch.setattr(checks, "MISSES_TO_REPLAN", 10**9)
    # Mixes that ran are ranked by their steps' wall time, nor does a mix that ran slower than
    # predicted try its plan's fallback.
    monkeypatch.setattr(block_modes.BlockModes, "measured", lambda self, key, ids: {})
    monkeypatch.setattr(mix_runs.Trials, "start", lambda self, key, plan, ran: None)
    # Keep views are not corrected by timed steps: ticks count marks, and a mix that saves less
    # takes fewer.
    monkeypatch.setattr(keep_views, "corrected", lambda *a, **k: None)
    # Nor is planning again rationed by the wall time the steps ran (may_replan).
    monkeypatch.setattr(block_modes, "PLANNING_SHARE", float("inf"))
    # Nor do plans made from the first step's times run their fallback until a later step is
    # timed: that guards against the first step's warm-up on a real clock, which this has not.
    monkeypatch.setattr(block_modes, "FIRST_PLANS_FALL_BACK", False)
    # Two figures a step takes from the wall clock beside the profiler's: the copy threads' own
    # CPU time, charged to each move (``move_seconds_each``): on a loaded 2-core CI machine it
    # once priced a move above a recompute of its block, and every block ran full (the plans
    # then depend on the machine's load); and the host arena's allocating time against the
    # step's (``checks.pinned``), which leaves a step out of what the plans learn.
    monkeypatch.setattr(cpu_copy.CpuCopyEngine, "take_cpu", lambda self: 0.0)
    monkeypatch.setattr(checks, "pinned", lambda profile: False)


def shared_cpu_noise(seed: int = 0) -> Callable[[], float]:
    """A step's time over its true time on a shared CPU, as the trial and ranking tests script
    it (noise only slows a step): 1 + |N(0, 0.12)|, one step in five 10-50% slower instead.
    Seeded: the same draws every run."""
    import random
    rng = random.Random(seed)

    def noise() -> float:
        return 1 + (abs(rng.gauss(0, 0.12)) if rng.random() < 0.8 else rng.uniform(0.1, 0.5))
    return noise

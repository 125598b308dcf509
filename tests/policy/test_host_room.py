"""Out of host memory, with ``model=``, recompute instead (issue 19, item 3).

When what a step would move exceeds ``host_memory_limit``, the engine keeps host bytes within the
limit and recomputes the rest: the mode search knows the limit (``plan_hybrid(host_limit=)``,
tested on hand-built views in ``planning/test_modes.py``) and, at run time, a block whose plan
keeps it while the host arena has no room left for it runs full. Without ``model=`` nothing can
be recomputed, and ``HostMemoryError`` says so as before."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import chameleon_swap as cs
from _helpers import assert_bitwise, grads, steady_planning
from _models import TModel, randn

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def case():
    """A 6-block model, its batch and reference gradients, a budget at 30% of its natural peak
    and the host memory a swap-only engine needs at that budget."""
    model = TModel(dim=64, n=6, seed=0)
    x = randn(2, 32, 64, seed=1)

    def run(m):
        torch.manual_seed(0)                 # dropout: the same mask every time
        loss = m(x)
        loss.backward()
        return loss.detach()
    ref = copy.deepcopy(model)
    ref_loss = run(ref)
    with cs.Chameleon(None, device="cpu", min_tensor_bytes=0) as probe:
        with probe.step():
            run(copy.deepcopy(model))
        budget = int(probe.last_step.peak_resident_bytes * 0.3)
    with cs.Chameleon(budget, device="cpu", min_tensor_bytes=0) as swap:
        with swap.step():
            run(copy.deepcopy(model))
        need = swap._pool.peak_in_use_bytes
    return dict(model=model, run=run, ref_loss=ref_loss, ref_grads=grads(ref), budget=budget,
                need=need)


@pytest.fixture
def steady_clock(monkeypatch):
    """Every profiler and runner timestamp 50 us after the previous one, and no correction from
    the wall clock: the plans then depend on the bytes alone (as in test_block_modes.py)."""
    steady_planning(monkeypatch)


@pytest.fixture(params=["steady", "emulated link"])
def clock(request):
    """Engine arguments for each clock a decision is tested on: the steady one above, and the
    real one with the copies slowed to a GPU's ratio of bytes to compute (the emulated link)."""
    if request.param == "steady":
        request.getfixturevalue("steady_clock")
        return {}
    return {"emulate_link": "200MB/s"}


def _steps(case, n, *, with_model=True, **kwargs):
    m = copy.deepcopy(case["model"])
    eng = cs.Chameleon(case["budget"], device="cpu", min_tensor_bytes=0,
                       **({"model": m} if with_model else {}), **kwargs)
    with eng:
        for _ in range(n):
            m.zero_grad(set_to_none=True)
            with eng.step():
                loss = case["run"](m)
            assert_bitwise(case["ref_loss"], case["ref_grads"], loss, grads(m))
            assert eng.last_step.peak_resident_bytes <= case["budget"], eng.last_step
    return eng


@pytest.mark.parametrize("share", [0.5, 0.3])
def test_with_model_a_small_host_limit_recomputes_instead(case, share):
    limit = int(case["need"] * share)
    with pytest.raises(cs.HostMemoryError, match="host_memory_limit reached"):
        _steps(case, 1, with_model=False, host_memory_limit=limit)
    free = _steps(case, 4)
    small = _steps(case, 4, host_memory_limit=limit)
    assert small._pool.peak_in_use_bytes <= limit
    # The first step has no plan: with room, every block is kept (and its swaps need more
    # host memory than the limit); without, blocks recompute from the first step on.
    assert free.history[0].block_modes[2] == 0
    assert all(s.block_modes[2] > 0 for s in small.history), small.history
    assert small.history[0].offloaded_bytes < free.history[0].offloaded_bytes


def test_the_mode_plan_keeps_its_copies_within_the_host_limit(case, clock, monkeypatch):
    """The host limit reaches the mode search. After a first step with every block kept (a
    large limit: its keep view is measured), the plans are made again for a smaller limit:
    they copy out no more than it and recompute more, and the step runs them. (Plans made
    from the first step's times would run their fallback, which copies nothing, until a later
    step is timed: off here, where the plans themselves are what is tested.)"""
    from chameleon_swap.policy import block_modes
    monkeypatch.setattr(block_modes, "FIRST_PLANS_FALL_BACK", False)
    m = copy.deepcopy(case["model"])
    # (plans made on the step's thread: ``_make`` below lands its plan at once)
    with cs.Chameleon(case["budget"], device="cpu", min_tensor_bytes=0, model=m, **clock,
                      plan_in_background=False) as eng:
        modes = eng._policy.modes

        def step():
            m.zero_grad(set_to_none=True)
            with eng.step():
                loss = case["run"](m)
            assert_bitwise(case["ref_loss"], case["ref_grads"], loss, grads(m))
            assert eng.last_step.peak_resident_bytes <= case["budget"]
        step()
        step()
        (key, _), = modes.plans.items()
        del modes.plans[key]           # planned afresh (no mix it runs now to stay with)
        # On the real clock, where the second step ran blocks full (its plan from the first
        # step's view), a full recompute was measured at 0.28x its block's kept forward (kept,
        # this tiny model's saves go through the engine's hooks and copies; recomputed, through
        # checkpoint's): then recomputing every block is the best plan, which copies nothing
        # and leaves nothing to limit (1 run in 4 of the full suite). A recompute costs its
        # forward here, on both clocks: the host room is what is tested.
        modes.full_seconds_ratio = None
        modes._make(key)
        free = modes.plans[key]
        assert free.hybrid.predicted.moved_bytes > 0 and free.hybrid.counts()[2] < 6
        limit = free.hybrid.predicted.moved_bytes // 2
        modes.host_limit = limit + 4096 * len(free.hybrid.profile.spans)   # pages: see _make
        modes._make(key)
        planned = modes.plans[key].hybrid
        assert planned.predicted.moved_bytes <= limit
        assert planned.counts()[2] > free.hybrid.counts()[2]
        step()
        # (one block may run selective once, to measure it, where the plan says full)
        assert eng.last_step.block_modes[0] == planned.counts()[0]
        step()


def test_with_no_host_room_the_plan_recomputes_and_warns_once(case, clock):
    """A budget so small that even recomputing every block needs copies (70% of the case's:
    all full then peaks above it), and no host room at all: the plan recomputes, and one
    warning says what it could not do. Either the swap search finds no set that fits (the mix
    copies nothing and peaks over the budget), or it finds one that copies a little, over the
    host limit (the emulated link's timing finds one; on the steady clock it depends on the
    search's order: since ties go to fewer moves, it finds one too). Each gets its warning."""
    m = copy.deepcopy(case["model"])
    budget = int(case["budget"] * 0.7)
    with cs.Chameleon(budget, device="cpu", min_tensor_bytes=0, model=m, **clock,
                      plan_in_background=False) as eng:          # (``_make`` lands at once)
        for _ in range(2):
            with eng.step():
                case["run"](m)
        modes = eng._policy.modes
        (key, free), = modes.plans.items()
        modes.host_limit = 0
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            modes._make(key)
            modes._make(key)
        least = modes.plans[key].hybrid
        assert least.counts()[2] > 0 and free.hybrid.predicted.moved_bytes > 0
        said = [str(w.message) for w in got if "chameleon-swap: no mix" in str(w.message)]
        assert len(said) == 1, said
        if least.predicted.moved_bytes == 0:
            # Copying nothing, the mix peaks over the budget: the warning says so, once.
            assert not least.predicted.budget_ok
            assert "fits the budget" in said[0] and "peaks at" in said[0], said
        else:
            # The swap planner found a set that fits the budget, which copies (it does not know
            # the host limit; the mode search only ranks mixes by it): the host warning says
            # what it would copy, once.
            assert least.predicted.budget_ok
            assert "host_memory_limit=0 B" in said[0] and "would copy" in said[0], said


def test_a_step_with_no_plan_on_a_cold_arena_recomputes_rather_than_wait_for_it(case,
                                                                                monkeypatch):
    """``host_room.cold``: on a step with no plan, a block that, kept with the blocks after it,
    would move more than the host arena has ready runs full (on CUDA every byte the guard moves
    into a cold arena is pinned first: the H100's capped schedule spent 44.9 s of 59.4 in its
    first step). Here allocating is slowed as pinning is (the arena's testing delay). The first
    step knows no block's size: every block runs full, and the recomputes count what they save
    (``BlockCall.kept_bytes``). The second keeps what fits without moves, runs the rest full and
    asks the arena for the room keeping them would need (room beside a recompute's working
    set: here no block fits so); once it is there, a step keeps every block (nothing waits for
    memory) and its keep view is learnt, and the size is planned."""
    from chameleon_swap.copy import host_pool
    fast = _steps(case, 1)                   # allocating is fast: kept, and its sizes measured
    assert fast.history[0].block_modes == (6, 0, 0)
    kept_per_input = fast._policy.host_room.saved_per_input
    monkeypatch.setenv(host_pool.ALLOC_DELAY_ENV, "40")           # 40 s per GiB: 2 MiB = 78 ms
    m = copy.deepcopy(case["model"])
    with cs.Chameleon(case["budget"], device="cpu", min_tensor_bytes=0, model=m,
                      plan_in_background=False) as eng:
        room, pool = eng._policy.host_room, eng._pool

        def step():
            m.zero_grad(set_to_none=True)
            with eng.step():
                loss = case["run"](m)
            assert_bitwise(case["ref_loss"], case["ref_grads"], loss, grads(m))
            s = eng.last_step
            assert s.peak_resident_bytes <= case["budget"], s
            return s
        first = step()
        assert first.block_modes == (0, 0, 6), first
        assert first.offloaded_bytes == 0 and first.host_wait_seconds == 0
        # counted in the recomputes: as kept blocks measure it, or a little more (inputs)
        assert kept_per_input <= room.saved_per_input <= 1.25 * kept_per_input
        second = step()             # kept as far as fits beside a recompute: here none
        assert second.block_modes[1] == 0 and second.block_modes[2] > 0, second
        assert second.offloaded_bytes == 0 and second.host_wait_seconds == 0
        assert room.cold_recomputes == 6 + second.block_modes[2]
        assert not eng._policy.modes.views                    # nothing kept whole: no view yet
        assert pool.wait_ahead(timeout=60) and pool.reserved_bytes > 0     # asked for
        third = step()
        assert third.block_modes == (6, 0, 0) and third.offloaded_bytes > 0, third
        assert third.host_wait_seconds == 0 and third.host_allocated_bytes == 0
        assert eng._policy.modes.views                        # learnt: planned from now on
        fourth = step()
        assert fourth.plan_source != "guard" and room.cold_recomputes == 6 + second.block_modes[2]


def test_a_planned_step_whose_moves_the_cold_arena_cannot_hold_keeps_only_what_fits(case,
                                                                                   monkeypatch):
    """``host_room.unready``: a step with a plan whose moves the arena cannot hold now (here
    the arena handed its memory back: ``HostPool.clear``) keeps only the blocks that fit
    without moves and runs the rest full while the arena is asked for the room: nothing waits
    for memory, no prediction is reported (the step did not run its plan's mix) and the bits
    are the plain step's. Once the arena holds the room again, the plan's mix runs."""
    from chameleon_swap.copy import host_pool
    from chameleon_swap.policy import block_modes, mix_runs
    monkeypatch.setenv(host_pool.ALLOC_DELAY_ENV, "40")           # 40 s per GiB: 2 MiB = 78 ms
    # A plan that moves, once made, stays: no fallback trials, no plans made again
    monkeypatch.setattr(block_modes.BlockModes, "may_replan", lambda self: False)
    monkeypatch.setattr(mix_runs.Trials, "start", lambda self, key, plan, ran: None)
    m = copy.deepcopy(case["model"])
    with cs.Chameleon(case["budget"], device="cpu", min_tensor_bytes=0, model=m,
                      plan_in_background=False) as eng:
        pool, modes, room = eng._pool, eng._policy.modes, eng._policy.host_room

        def step():
            m.zero_grad(set_to_none=True)
            with eng.step():
                loss = case["run"](m)
            assert_bitwise(case["ref_loss"], case["ref_grads"], loss, grads(m))
            assert eng.last_step.peak_resident_bytes <= case["budget"], eng.last_step
            assert pool.wait_ahead(timeout=60)
            return eng.last_step
        for _ in range(8):                       # measured, kept whole, then planned
            planned = step()
            if planned.offloaded_bytes and planned.predicted_step_seconds:
                break
        assert planned.offloaded_bytes > 0 and planned.block_modes[0] > 0, planned
        pool.clear()
        before = room.cold_recomputes
        cold = step()
        assert modes.unready, cold
        assert cold.host_wait_seconds == 0 and cold.host_allocated_bytes == 0, cold
        assert cold.predicted_step_seconds is None and room.cold_recomputes > before
        assert cold.offloaded_bytes < planned.offloaded_bytes
        warm = step()                            # the room asked for is there
        assert not modes.unready and warm.predicted_step_seconds is not None, warm


def test_a_mix_that_ran_under_the_budget_is_no_case_for_the_no_mix_fits_warning(case):
    """The mode search ranks a mix that ran under this budget as fitting it (the guard held the
    budget, and its time says what that cost), where the model may read it over: landing such
    a plan warns of nothing. The same plan, read over and never run, warns once."""
    from dataclasses import replace
    m = copy.deepcopy(case["model"])
    with cs.Chameleon(case["budget"], device="cpu", min_tensor_bytes=0, model=m,
                      plan_in_background=False) as eng:
        for _ in range(2):
            with eng.step():
                case["run"](m)
        modes = eng._policy.modes
        (key, plan), = modes.plans.items()
        hp = plan.hybrid
        over = replace(hp, swap=replace(hp.swap, predicted=replace(
            hp.predicted, peak_bytes=modes.budget + 1)))      # the model reads it over
        job = modes._job(key)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            modes._land(key, replace(job, held={hp.modes}), over)
            assert not [w for w in got if "chameleon-swap: no mix" in str(w.message)]
            modes._land(key, replace(job, held=set()), over)
            modes._land(key, replace(job, held=set()), over)
        said = [str(w.message) for w in got if "chameleon-swap: no mix" in str(w.message)]
        assert len(said) == 1 and "peaks at" in said[0], said

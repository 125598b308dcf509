"""The planner process (``policy/background.py``), and plans made in it (``size_plans.py``)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest

import chameleon_swap as cs
from chameleon_swap.planning.jobs import plan_size
from chameleon_swap.planning.timeline import unmoved_peak
from chameleon_swap.policy import background, size_plans
from chameleon_swap.policy.background import Worker
from chameleon_swap.policy.mix_runs import until_warm

from _helpers import compare, natural_peak, train_step
from _models import lm_batches, tiny_llama
from _traces import gpu_keep_view



def _args(prof, blocks, frac):
    return (prof, blocks, int(unmoved_peak(prof) * frac), None, None, {}, False)


def test_the_planner_process_makes_the_plans_this_process_would():
    # The H100's own traces, three budgets each, handed over at once: the process answers every
    # ticket with the plan made here, field for field (pure Python, no hash order in it).
    jobs = [_args(*gpu_keep_view(name), frac)
            for name in ("h4096-unreached-16384", "h4096-b10GiB-model-16384")
            for frac in (0.25, 0.5, 0.75)]
    w = Worker()
    try:
        tickets = [w.submit("plan_size", *a) for a in jobs]
        assert None not in tickets and w.broken is None
        for t, a in zip(tickets, jobs):
            seconds, ok, plan = w.result(t)
            assert ok and seconds > 0 and plan == plan_size(*a)
    finally:
        w.close()
    assert w.broken == "the planner process was closed"
    assert w._proc.wait(5) == 0               # it ended at the end of its input



def test_the_worker_tells_how_long_it_had_jobs_since_a_moment():
    # What tells a step that the planner process worked beside it (``step_end.
    # planner_busy_seconds``): the time it had jobs, from a hand-over to the answer.
    import time
    a = _args(*gpu_keep_view("h4096-unreached-16384"), 0.25)
    w = Worker()
    try:
        before = time.perf_counter()
        assert w.busy_seconds(before) == 0.0          # nothing handed over yet
        t0 = time.perf_counter()
        tickets = [w.submit("plan_size", *a) for _ in range(3)]     # one run of three jobs
        time.sleep(0.05)
        assert w.busy_seconds(t0) >= 0.05              # still waiting: busy up to now
        for t in tickets:
            w.result(t)
        t1 = time.perf_counter()
        busy = w.busy_seconds(before)
        assert 0.05 <= busy <= t1 - t0
        assert w.busy_seconds(before) == busy           # nothing since: it does not grow
        assert w.busy_seconds(t1) == 0.0
        dropped = w.submit("plan_size", *a)
        w.drop(dropped)                                 # a dropped job keeps it busy too
        deadline = time.monotonic() + 60
        while w._shared.waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.busy_seconds(t1) > 0.0
    finally:
        w.close()


def test_the_planner_process_runs_without_torch():
    # The stand-in package keeps the package's __init__ (and torch) out of the process.
    probe = background.BOOT.replace(
        "serve(sys.stdin.buffer, out)",
        "out.write(repr(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'numpy'))).encode())")
    here = os.path.dirname(os.path.dirname(background.__file__))
    got = subprocess.run([sys.executable, "-I", "-S", "-c", probe, here], capture_output=True,
                         timeout=60, check=True)
    assert got.stdout == b"[]", got


def test_a_worker_that_cannot_start_says_why_and_takes_no_job(monkeypatch):
    monkeypatch.setattr(background.sys, "executable", "/nonexistent/python")
    w = Worker()
    assert w.submit("plan_size", 1) is None
    assert w.broken.startswith("the planner process could not start")


def test_a_ticket_dropped_before_its_answer_never_comes_back():
    prof, blocks = gpu_keep_view("h4096-unreached-16384")
    w = Worker()
    try:
        first = w.submit("plan_size", *_args(prof, blocks, 0.25))
        second = w.submit("plan_size", *_args(prof, blocks, 0.5))
        w.drop(first)
        assert w.result(second)[1]
        assert first not in w._shared.done and not w._shared.dropped   # (answered, discarded)
    finally:
        w.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_of_the_owner_leaves_its_planner_process_alone():
    # A data loader's worker forked after the planner started holds a copy of the worker; its
    # exit runs the copy's finalizer, which must not end (or kill) its owner's process.
    prof, blocks = gpu_keep_view("h4096-unreached-16384")
    w = Worker()
    try:
        assert w.result(w.submit("plan_size", *_args(prof, blocks, 0.5)))[1]
        pid = os.fork()
        if pid == 0:                            # the fork: what its exit would run, then out
            try:
                w._stop()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert w._proc.poll() is None
        assert w.result(w.submit("plan_size", *_args(prof, blocks, 0.25)))[1]
    finally:
        w.close()


# --------------------------------------------------------------------------- with the engine
@contextlib.contextmanager
def _trained(lengths):
    """An engine (planner process on) after a step of each length, its plans landed: yields
    (engine, its block modes, a planned size, the model, its batches, the budget), size set."""
    model = tiny_llama(dim=64, n_layers=3, max_seq_len=256)
    batches = lm_batches(model, lengths, B=2)
    budget = int(min(natural_peak(model, b) for b in batches) * 0.3)
    with cs.Chameleon(budget, device="cpu", min_tensor_bytes=0, model=model,
                      emulate_link="200MB/s") as eng:
        modes = eng._policy.modes
        for b in batches:
            train_step(model, b, eng)
        modes.collect(wait=True)
        key = next(iter(modes.plans))
        modes.input_bytes = modes.plans[key].input_bytes
        yield eng, modes, key, model, batches, budget


def test_plans_made_in_the_planner_process_hold_the_budget_and_every_bit():
    # The real clock and the emulated link: sizes run whatever plan has landed when they
    # begin (their own, or the nearest size's), and every loss and gradient stays bitwise and
    # every step within its budget (``compare``). Once the plans made so far have landed (after
    # the sixth step, waited for here), each size runs its own, from the cache.
    model = tiny_llama(dim=64, n_layers=3, max_seq_len=256)
    lengths = [96, 160, 128] * 3
    seen = []

    def between(eng):
        seen.append(eng)
        if len(seen) == 6:
            eng._policy.modes.collect(wait=True)
    history, _, _ = compare(model, lm_batches(model, lengths), 0.3, model_kwarg=True,
                            emulate_link="200MB/s", between=between)
    assert [s.plan_source for s in history[6:]] != [] and all(
        s.plan_source in ("cache", "replanned") for s in history[6:]), history
    worker = seen[0]._policy.modes.worker
    assert worker._next >= 3                    # (every size's plan went to the process)
    # The process's time on them is reported by the steps they land before, apart from the
    # steps' own times, and charged to the planning share as well (the mode plans'; swap plans
    # made there, policy/swap_jobs.py, are reported with them and kept apart).
    beside = [s.background_planning_seconds for s in history]
    assert all(b >= 0 for b in beside) and sum(beside) > 0
    pol = seen[0]._policy
    assert sum(beside) <= pol.modes.planning_seconds + pol.swap_jobs.seconds + 1e-9
    assert all(s.background_planning_seconds == 0 for s in _sync_history()), "on the thread"
    assert worker.broken == "the planner process was closed"           # with the engine
    assert worker._proc.wait(5) is not None


def _sync_history():
    model = tiny_llama(dim=64, n_layers=3, max_seq_len=256)
    history, _, _ = compare(model, lm_batches(model, [96, 160, 96]), 0.3, model_kwarg=True,
                            emulate_link="200MB/s", plan_in_background=False)
    return history


def test_a_plan_is_handed_over_then_lands_as_made_here():
    with _trained([96, 160, 96, 160]) as (eng, modes, key, *_):
        before = modes.plans[key]
        modes._make(key)                                    # handed over: not made here
        job = modes.jobs[key]
        assert modes.plans[key] is before and job.ticket is not None
        modes._make(key)                                    # a second replaces the first
        assert modes.jobs[key] is not job and job.ticket not in modes.worker._shared.done
        job = modes.jobs[key]
        modes.replan(key, 0.5)                              # one is being made: put off
        assert key in modes.stale and key in modes.put_off and modes.jobs[key] is job
        assert modes.compute_scale.get(key, 1.0) == 1.0     # and no correction taken
        spent = modes.planning_seconds
        modes.collect(wait=True)
        assert not modes.jobs and modes.planning_seconds > spent    # its time is charged
        assert modes.plans[key].hybrid == until_warm(plan_size(*job.args), job.trusted)


def test_where_the_planner_process_dies_the_plan_is_made_here():
    with _trained([96, 160, 96]) as (eng, modes, key, model, batches, budget):
        modes.worker._proc.kill()
        modes.worker._proc.wait(5)
        modes._make(key)                 # handed over before the death is seen, or made here
        job = modes.jobs.get(key)
        modes.collect(wait=True)
        assert modes.worker.broken is not None and not modes.jobs
        if job is not None:
            assert modes.plans[key].hybrid == until_warm(plan_size(*job.args), job.trusted)
        for b in batches:                # and the steps go on, planned here
            train_step(model, b, eng)
        assert not modes.jobs and eng.last_step.peak_resident_bytes <= budget


def test_a_plan_the_process_keeps_waiting_is_made_here_after_the_deadline(monkeypatch):
    # A planner process starved of a core: its answers never come. The size runs what it ran
    # until the deadline, then the plan is made on the step's thread from the same inputs, the
    # process's ticket is dropped, and the steps go on within budget (the real clock). The
    # deadline is in steps and in seconds both: a tiny model's fast steps alone do not reach it.
    with _trained([96, 160, 96]) as (eng, modes, key, model, batches, budget):
        monkeypatch.setattr(modes.worker, "ready", lambda ticket: False)
        before = modes.plans[key]
        modes._make(key)
        job = modes.jobs[key]
        for _ in range(size_plans.DEADLINE_STEPS + 2):      # (well within DEADLINE_SECONDS)
            modes.collect()
            assert modes.jobs.get(key) is job and modes.plans[key] is before
        monkeypatch.setattr(size_plans, "DEADLINE_SECONDS", 0.0)
        spent = modes.planning_seconds
        modes.collect()                                     # the deadline: made here
        assert key not in modes.jobs and modes.planning_seconds > spent
        assert modes.plans[key].hybrid == until_warm(plan_size(*job.args), job.trusted)
        monkeypatch.undo()                                  # the process answers again
        # The process answers in order: once a later job's answer is in, the late one's came
        # and was thrown away (dropped), never to land.
        w = modes.worker
        assert w.result(w.submit("plan_size", *job.args))[1]
        assert job.ticket not in w._shared.done and job.ticket not in w._shared.dropped
        for b in batches:
            train_step(model, b, eng)
            assert eng.last_step.peak_resident_bytes <= budget


def test_plan_in_background_is_checked():
    with pytest.raises(TypeError, match="plan_in_background must be True"):
        cs.Chameleon(None, plan_in_background="yes")

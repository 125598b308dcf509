"""Swap plans made in the planner process (``policy/swap_jobs.py``)."""
from __future__ import annotations

import time
from types import SimpleNamespace

from chameleon_swap.planning.cache import PlanCache, PlanEntry
from chameleon_swap.planning.swaps import plan as make_plan
from chameleon_swap.planning.timeline import unmoved_peak
from chameleon_swap.policy import swap_jobs
from chameleon_swap.policy.background import Worker
from chameleon_swap.policy.swap_jobs import SwapJobs

from _helpers import compare
from _models import lm_batches, tiny_llama
from _traces import gpu_keep_view


def test_the_planner_process_makes_the_swap_plans_this_process_would():
    # The H100's own trace at three budgets: the process answers with the plan made here.
    prof, _ = gpu_keep_view("h4096-b10GiB-model-16384")
    budgets = [int(unmoved_peak(prof) * f) for f in (0.25, 0.5, 0.75)]
    w = Worker()
    try:
        tickets = [w.submit("plan_swaps", prof, b) for b in budgets]
        for t, b in zip(tickets, budgets):
            seconds, ok, got = w.result(t)
            assert ok and got == make_plan(prof, b)
    finally:
        w.close()


def test_slow_swap_plans_are_made_beside_the_steps_and_land_in_the_cache(monkeypatch):
    # Real clock, emulated link, the engine's planner process. Every plan counts as slow here,
    # so after the first (made on the step's thread) each new sequence's plan goes to the
    # process: the step that asked ends without it, and a later step's end caches it, as made
    # from the step that asked. Every loss and gradient stays bitwise and every step within its
    # budget meanwhile (``compare``).
    monkeypatch.setattr(swap_jobs, "BACKGROUND_SECONDS", 0.0)
    model = tiny_llama(dim=64, n_layers=3, max_seq_len=256)
    lengths = [96, 160, 128, 64] * 3 + [96] * 6
    handed: dict = {}           # ticket -> (signature, the step whose end handed it over)
    landed: dict = {}           # ticket -> (the step whose end took it, its entry's made_at)
    steps = []

    def between(eng):
        pol = eng._policy
        now = pol.step_no - 1
        pending = {job[0] for job in pol.swap_jobs.pending.values()}
        for sig, job in pol.swap_jobs.pending.items():
            handed.setdefault(job[0], (sig, now))
        for ticket, (sig, at) in handed.items():
            if ticket not in pending and ticket not in landed:
                entry = pol.cache.peek(sig)
                landed[ticket] = (now, None if entry is None else entry.made_at)
        steps.append(eng)

    compare(model, lm_batches(model, lengths), 0.3, model_kwarg=True, emulate_link="200MB/s",
            between=between)
    assert handed, "no plan went to the planner process"
    assert landed, f"none of {len(handed)} plans handed over landed in {len(lengths)} steps"
    for ticket, (at, made_at) in landed.items():
        assert at > handed[ticket][1] and made_at is not None and made_at >= handed[ticket][1]
    # (made_at later than the step that asked: a newer plan of the sequence was there first)
    assert any(made_at == handed[t][1] for t, (_, made_at) in landed.items()), (handed, landed)
    assert steps[0]._policy.swap_jobs.slow


def test_a_landed_plan_gives_way_to_a_newer_one_and_a_failed_job_is_dropped(monkeypatch):
    made = []
    monkeypatch.setattr(swap_jobs, "entry_of", lambda prof, plan, step, pinned: made.append(
        (prof, plan, step, pinned)) or PlanEntry("sig-a", [], [], 0, [], {}, [], 0.0, 0, True,
                                                  made_at=step))
    answers = {1: (0.5, True, "plan-a"), 2: (0.25, True, "plan-b"), 3: (0.0, False, "died")}
    worker = SimpleNamespace(ready=lambda t: t != 4, result=lambda t: answers[t], broken=None)
    cache = PlanCache(8)
    newer = PlanEntry("sig-b", [], [], 0, [], {}, [], 0.0, 0, True, made_at=9)
    cache.put(newer)
    pol = SimpleNamespace(modes=SimpleNamespace(worker=worker, landed_seconds=0.0), cache=cache)
    jobs = SwapJobs()
    jobs.pending = {"sig-a": (1, "prof-a", 5, False), "sig-b": (2, "prof-b", 7, True),
                    "sig-c": (3, "prof-c", 8, False), "sig-d": (4, "prof-d", 8, False)}
    jobs.land(pol)
    assert made == [("prof-a", "plan-a", 5, False)]         # sig-b: a newer plan is there
    assert cache.peek("sig-a").made_at == 5 and cache.peek("sig-b") is newer
    assert cache.peek("sig-c") is None                      # failed: nothing cached
    assert list(jobs.pending) == ["sig-d"]                  # not answered yet: still pending
    assert pol.modes.landed_seconds == jobs.seconds == 0.75    # the answers' time, reported


def test_plans_go_to_the_process_only_after_a_slow_one_and_never_pile_up(monkeypatch):
    clock = iter([0.0, 0.001, 1.0, 1.5] + [2.0] * 8)
    monkeypatch.setattr(swap_jobs, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    submitted = []
    worker = SimpleNamespace(broken=None, submit=lambda *a: submitted.append(a) or len(submitted))
    made = []
    pol = SimpleNamespace(modes=SimpleNamespace(worker=worker), ex=SimpleNamespace(budget=100),
                          step_no=3, pinned_step=False, timeline=lambda p: ("tl", p),
                          _make=lambda p: made.append(p) or f"entry-{p.signature}")
    jobs = SwapJobs()
    prof = [SimpleNamespace(signature=f"s{i}") for i in range(12)]
    assert jobs.make(pol, prof[0]) == "entry-s0" and not jobs.slow      # 1 ms: stays here
    assert jobs.make(pol, prof[1]) == "entry-s1" and jobs.slow          # 500 ms: the next go
    for p in prof[2:2 + swap_jobs.MAX_PENDING]:
        assert jobs.make(pol, p) is None
    assert jobs.make(pol, prof[2]) is None and len(submitted) == swap_jobs.MAX_PENDING
    assert submitted[0] == ("plan_swaps", ("tl", prof[2]), 100)         # (already in flight)
    assert jobs.make(pol, prof[-1]) == "entry-s11"                      # full: made here
    assert [p.signature for p in made] == ["s0", "s1", "s11"]


def test_on_the_real_clock_plans_go_to_the_process_after_one_made_here_ran_long(monkeypatch):
    # The twin of the stub-clock test above: the real clock, the emulated link, the engine's own
    # planner process, a threshold of 1 ms (a plan of this Llama takes longer on this CPU). Each
    # call of ``SwapJobs.make`` is checked against the rule: made here until one made here took
    # longer than the threshold, handed over from then on while fewer than the cap are there.
    monkeypatch.setattr(swap_jobs, "BACKGROUND_SECONDS", 0.001)
    calls = []
    real_make = SwapJobs.make

    def make(self, policy, profile):
        before = (self.slow, len(self.pending), profile.signature in self.pending)
        t0 = time.perf_counter()
        entry = real_make(self, policy, profile)
        calls.append((before, time.perf_counter() - t0, entry is None, self.slow))
        return entry
    monkeypatch.setattr(SwapJobs, "make", make)
    model = tiny_llama(dim=64, n_layers=3, max_seq_len=256)
    compare(model, lm_batches(model, [96, 160, 128, 64] * 3), 0.3, model_kwarg=True,
            emulate_link="200MB/s")
    assert calls and not calls[0][2]                        # the first is made here
    for (slow, pending, inflight), took, handed, slow_after in calls:
        if inflight:
            assert handed
        elif slow and pending < swap_jobs.MAX_PENDING:
            assert handed and slow_after                    # (the worker ran throughout)
        else:
            assert not handed
            assert took > 0.001 if slow_after else took < 0.001 + 0.005, (took, slow_after)
    # (tolerance one way only: ``took`` is timed around the call, the rule's time inside it, so
    # a call under the threshold inside can read up to a few ms more here on a busy machine)
    assert any(handed for *_, handed, _ in calls), "no plan here took over 1 ms: nothing went"

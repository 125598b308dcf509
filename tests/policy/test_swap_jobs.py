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
    jobs.pending = {"sig-a": (1, "prof-a", 5, False, None), "sig-b": (2, "prof-b", 7, True, None),
                    "sig-c": (3, "prof-c", 8, False, None), "sig-d": (4, "prof-d", 8, False, None)}
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


def test_a_plan_that_took_a_share_of_its_step_sends_the_next_ones_too(monkeypatch):
    # Stub clock: under the absolute threshold (20 ms), a plan is slow where it took more than
    # BACKGROUND_SHARE of the step that asked, and more than BACKGROUND_MIN_SECONDS: 8 ms after a
    # 100 ms step is; 8 ms after a 400 ms step is not (20 ms would be), nor 3 ms after a 10 ms
    # step (under the floor), nor a profile without a step time (the absolute rule alone).
    took = iter([0.008, 0.008, 0.003, 0.019])
    now = [0.0]

    def perf_counter():
        now[0] += next(took) if len(calls) % 2 else 0.0
        calls.append(now[0])
        return now[0]
    calls: list = []
    monkeypatch.setattr(swap_jobs, "time", SimpleNamespace(perf_counter=perf_counter))
    pol = SimpleNamespace(modes=SimpleNamespace(worker=None), _make=lambda p: "entry")
    jobs = SwapJobs()
    for step, slow in ((0.1, True), (0.4, False), (0.01, False), (None, False)):
        assert jobs.make(pol, SimpleNamespace(signature="s", step_seconds=step)) == "entry"
        assert jobs.slow is slow, (step, slow)


def test_a_plan_made_again_replaces_the_one_in_the_process_and_lands_replanned(monkeypatch):
    # A sequence whose plan missed is planned again from the step that missed (``again``: the
    # missed plan's ``detailed``). Where plans go to the process, the job for the same sequence
    # still there (made from an older step) is dropped for the new one; landed, the plan reads
    # replanned and keeps the missed plan's detail. Made here, it is marked the same at once.
    made = []
    monkeypatch.setattr(swap_jobs, "entry_of", lambda prof, plan, step, pinned: made.append(
        (prof, plan, step)) or PlanEntry(prof.signature, [], [], 0, [], {}, [], 0.0, 0, False,
                                         made_at=step))
    submitted, dropped, answers = [], [], {}
    worker = SimpleNamespace(broken=None, drop=dropped.append,
                             submit=lambda *a: submitted.append(a) or len(submitted),
                             ready=lambda t: t in answers, result=lambda t: answers.pop(t))
    cache = PlanCache(8)
    pol = SimpleNamespace(modes=SimpleNamespace(worker=worker, landed_seconds=0.0), cache=cache,
                          ex=SimpleNamespace(budget=100), step_no=4, pinned_step=False,
                          timeline=lambda p: ("tl", p.n), _make=lambda p: PlanEntry(
                              p.signature, [], [], 0, [], {}, [], 0.0, 0, False, made_at=3))
    jobs = SwapJobs()
    jobs.slow = True
    first, again = (SimpleNamespace(signature="s", n=n, step_seconds=0.1) for n in (1, 2))
    assert jobs.make(pol, first) is None and jobs.make(pol, first) is None   # (one job)
    pol.step_no = 6
    assert jobs.make(pol, again, again=True) is None
    assert dropped == [1] and [a[1] for a in submitted] == [("tl", 1), ("tl", 2)]
    answers[2] = (0.01, True, "plan-again")
    jobs.land(pol)
    entry = cache.peek("s")
    assert made == [(again, "plan-again", 6)] and entry.replanned and entry.detailed
    jobs.slow, pol.modes.worker = False, None         # made here: marked at once
    here = jobs.make(pol, SimpleNamespace(signature="t", step_seconds=None), again=False)
    assert here.replanned and not here.detailed


def test_while_the_process_is_behind_plans_are_made_here():
    # A job unanswered for more than BEHIND_STEPS steps: the process is behind (a starved
    # machine), so the next plans, a plan made again for that very sequence among them, are
    # made on the step's thread; the job of the sequence made again is dropped. (The real
    # clock's twin: test_checks' swap plan made again while the process lands nothing.)
    submitted, dropped = [], []
    worker = SimpleNamespace(broken=None, drop=dropped.append,
                             submit=lambda *a: submitted.append(a) or len(submitted))
    pol = SimpleNamespace(modes=SimpleNamespace(worker=worker), ex=SimpleNamespace(budget=100),
                          step_no=1, pinned_step=False, timeline=lambda p: p.signature,
                          _make=lambda p: PlanEntry(p.signature, [], [], 0, [], {}, [], 0.0, 0,
                                                    False, made_at=9))
    jobs = SwapJobs()
    jobs.slow = True
    prof = {s: SimpleNamespace(signature=s, step_seconds=None) for s in "abc"}
    assert jobs.make(pol, prof["a"]) is None                         # handed over at step 1
    pol.step_no = 1 + swap_jobs.BEHIND_STEPS
    assert jobs.make(pol, prof["b"]) is None and len(submitted) == 2     # not behind yet
    pol.step_no += 1
    assert jobs.make(pol, prof["c"]).signature == "c"                # behind: made here
    again = jobs.make(pol, prof["a"], again=True)
    assert again.signature == "a" and again.replanned and dropped == [1]
    assert list(jobs.pending) == ["b"] and len(submitted) == 2


def _steps_checked_beside_the_planner(monkeypatch) -> None:
    """Steps the planner process worked beside are checked and learnt from, as before that rule
    (``checks.slowed``): on this project's 2-core CPU the early steps' misses, read while the
    first mode plans were made, were what asked for the swap plans these tests watch, and with
    them left out a run could ask for one plan only (2 runs of 4 here)."""
    from chameleon_swap.runtime import step_end
    monkeypatch.setattr(step_end, "planner_busy_seconds", lambda eng, since: 0.0)


def test_on_the_real_clock_plans_go_to_the_process_after_one_made_here_ran_long(monkeypatch):
    # The twin of the stub-clock test above: the real clock, the emulated link, the engine's own
    # planner process, a threshold of 1 ms (a plan of this Llama takes longer on this CPU). Each
    # call of ``SwapJobs.make`` is checked against the rule: made here until one made here took
    # longer than the threshold, handed over from then on while fewer than the cap are there
    # and the process is not behind (a job unanswered for more than BEHIND_STEPS steps: on a
    # loaded 2-core CI machine it was, and the plan was rightly made here).
    monkeypatch.setattr(swap_jobs, "BACKGROUND_SECONDS", 0.001)
    _steps_checked_beside_the_planner(monkeypatch)
    calls = []
    real_make = SwapJobs.make

    def make(self, policy, profile, again=None):
        inflight = profile.signature in self.pending and again is None
        free = (len(self.pending) < swap_jobs.MAX_PENDING
                and not (self.pending and self.behind(policy.step_no)))
        before = (self.slow, free, inflight)
        t0 = time.perf_counter()
        entry = real_make(self, policy, profile, again)
        calls.append((before, time.perf_counter() - t0, entry is None, self.slow))
        return entry
    monkeypatch.setattr(SwapJobs, "make", make)
    model = tiny_llama(dim=64, n_layers=3, max_seq_len=256)
    batches = lm_batches(model, [96, 160, 128, 64] * 3)
    steps = []

    def between(eng):
        # A run can find its first plan holding every later step (by keys) and ask for no
        # other (at 30% of the peak 1 run in 4 alone; at 20% none in 12 alone, yet in the policy
        # suite): the last step then asks for its own plan again, once, as a miss would.
        steps.append(eng)
        if len(steps) == len(batches) and len(calls) < 2:
            eng._policy.swap_jobs.make(eng._policy, eng._profiler.last_profile)
    compare(model, batches, 0.2, model_kwarg=True, emulate_link="200MB/s", between=between)
    assert calls and not calls[0][2]                        # the first is made here
    for (slow, free, inflight), took, handed, slow_after in calls:
        if inflight:
            assert handed
        elif slow and free:
            assert handed and slow_after                    # (the worker ran throughout)
        else:
            assert not handed
            assert took > 0.001 if slow_after else took < 0.001 + 0.005, (took, slow_after)
    # (tolerance one way only: ``took`` is timed around the call, the rule's time inside it, so
    # a call under the threshold inside can read up to a few ms more here on a busy machine)
    assert any(handed for *_, handed, _ in calls), (
        "no plan here took over 1 ms: nothing went",
        [(before, round(took * 1e3, 2), handed) for before, took, handed, _ in calls])


def test_on_the_real_clock_a_plan_over_its_share_of_the_step_sends_the_next_ones(monkeypatch):
    # The twin of the stub-clock share test: the real clock, the emulated link, the engine's own
    # planner process; no absolute threshold (1 s) and no floor, a share of 2%: each call of
    # ``SwapJobs.make`` made here must leave ``slow`` set exactly where its plan took more than
    # 2% of the step that asked (a plan of this Llama takes over a millisecond, its steps tens).
    monkeypatch.setattr(swap_jobs, "BACKGROUND_SECONDS", 1.0)
    monkeypatch.setattr(swap_jobs, "BACKGROUND_MIN_SECONDS", 0.0)
    monkeypatch.setattr(swap_jobs, "BACKGROUND_SHARE", 0.02)
    _steps_checked_beside_the_planner(monkeypatch)
    calls = []
    real_make = SwapJobs.make

    def make(self, policy, profile, again=None):
        before = self.slow and len(self.pending) < swap_jobs.MAX_PENDING
        t0 = time.perf_counter()
        entry = real_make(self, policy, profile, again)
        calls.append((before, time.perf_counter() - t0, entry is None, self.slow,
                      profile.step_seconds))
        return entry
    monkeypatch.setattr(SwapJobs, "make", make)
    model = tiny_llama(dim=64, n_layers=3, max_seq_len=256)
    batches = lm_batches(model, [96, 160, 128, 64] * 3)
    steps = []

    def between(eng):
        # As in the test above: a run can ask for one plan only (its first holding every later
        # step by keys; at 30% of the peak a fresh-clone suite of 2026-11-28 failed so, "no
        # plan went"). If none was handed over by the last step, it asks again, once.
        steps.append(eng)
        if len(steps) == len(batches) and not any(c[2] for c in calls):
            eng._policy.swap_jobs.make(eng._policy, eng._profiler.last_profile)
    compare(model, batches, 0.2, model_kwarg=True, emulate_link="200MB/s", between=between)
    here = [c for c in calls if not c[2]]
    assert here, "no plan was made on the step's thread"
    for _, took, _, slow_after, step in here:
        limit = 0.02 * step
        # (``took`` is timed around the call, the rule's time inside it: one way only)
        assert took > limit if slow_after else took < limit + 0.005, (took, step, slow_after)
    assert any(handed for _, _, handed, _, _ in calls), (
        "no plan went to the process", [(round(t * 1e3, 2), h, sl, round(st * 1e3)) for
                                        _, t, h, sl, st in calls])


def test_a_plan_from_a_slowed_step_is_made_again_and_predicts_unless_the_arena_pinned():
    # ``entry_of``: a step exempt for what slowed it gives a plan that is made again from the
    # next detailed step. Slowed by the planner process, its prediction stands (it reads high,
    # never a miss: a step that applied such a plan once reported none, failing the rule that
    # every plan carries one); slowed by the host arena's pinning, its figures are 10-20x off
    # and it predicts nothing.
    def profile(**extra):
        return SimpleNamespace(signature="s", ids=[1, 2], keys=["a", "b"], n_forward=2,
                               use_slot=[3, 2], n_slots=4, nbytes=[8, 8], detailed=True,
                               blocks=[], step_seconds=0.5, extra=extra)
    predicted = SimpleNamespace(stall_seconds=0.1, peak_bytes=8, total_seconds=0.6)
    plan = SimpleNamespace(move=[0], fetch_at={}, predicted=predicted, budget=16)
    clean = swap_jobs.entry_of(profile(), plan, 3, slowed=False)
    by_planner = swap_jobs.entry_of(profile(planner_seconds=0.4), plan, 3, slowed=True)
    by_arena = swap_jobs.entry_of(profile(host_alloc_seconds=0.4), plan, 3, slowed=True)
    assert clean.detailed and clean.predicted_step_seconds == 0.6
    assert not by_planner.detailed and by_planner.predicted_step_seconds == 0.6
    assert not by_arena.detailed and by_arena.predicted_step_seconds == 0.0
    assert clean.move == by_planner.move == by_arena.move == [True, False]

"""``StepStats.step_seconds`` is the step's device-inclusive time, or None until it is known
(issue 19, item 5). A step that synchronizes at its end measures its wall time; on CUDA a step
with no budget is timed by events recorded at its start and end, read a step late without
synchronizing. The event logic is tested here with fake events, on any machine."""
from __future__ import annotations

import pytest
import torch

import chameleon_swap as cs
import chameleon_swap.engine as engine_mod
from chameleon_swap.runtime.step_end import StepTimer
from chameleon_swap.runtime.stats import StepTotals


class FakeClock:
    def __init__(self) -> None:
        self.ms = 0.0


class FakeEvent:
    """Records the fake clock's time; completes only when the test says so."""

    def __init__(self, clock: FakeClock, log: list) -> None:
        self.clock, self.log = clock, log
        self.t = None
        self.done = False

    def record(self, stream=None) -> None:
        self.t = self.clock.ms
        self.log.append(self)

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.done and end.done, "read before the events completed"
        return end.t - self.t

    def synchronize(self) -> None:            # never called: no step may wait for the device
        raise AssertionError("the step timer synchronized")


def fake_timer():
    clock, log = FakeClock(), []
    timer = StepTimer(torch.device("cpu"), new_event=lambda: FakeEvent(clock, log),
                      stream=lambda: None)
    return timer, clock, log


class S:                                        # the StepStats fields the timer touches
    step_seconds = None


def test_timer_fills_a_step_late_once_its_end_event_completed():
    timer, clock, log = fake_timer()
    totals = StepTotals()
    steps = []
    for i in range(3):
        timer.begin(True)
        assert timer.lagging
        clock.ms += 100.0 * (i + 1)             # 0.1 s, 0.2 s, 0.3 s of device time
        st = S()
        timer.end(st, totals)
        assert not timer.lagging
        steps.append(st)
    assert [s.step_seconds for s in steps] == [None, None, None]   # no event completed
    assert totals.step_seconds == 0.0
    log[0].done = log[1].done = True            # step 0's start and end
    timer.resolve(totals)
    assert steps[0].step_seconds == pytest.approx(0.1)
    assert steps[1].step_seconds is None
    assert totals.step_seconds == pytest.approx(0.1)
    for e in log:
        e.done = True
    timer.begin(False)                          # a synchronized step: no events of its own
    assert not timer.lagging
    timer.end(S(), totals)                      # resolves the two still pending, oldest first
    assert [s.step_seconds for s in steps] == pytest.approx([0.1, 0.2, 0.3])
    assert totals.step_seconds == pytest.approx(0.6)
    assert len(log) == 6                        # two events per timed step, none for the other


def test_timer_stops_at_the_first_end_not_completed_and_bounds_what_waits():
    timer, clock, log = fake_timer()
    totals = StepTotals()
    steps = []
    for _ in range(StepTimer.MAX_PENDING + 2):
        timer.begin(True)
        clock.ms += 10.0
        steps.append(S())
        timer.end(steps[-1], totals)
    assert len(timer._pending) == StepTimer.MAX_PENDING
    log[-1].done = True                         # only the newest: the older ones block it
    timer.resolve(totals)
    assert steps[-1].step_seconds is None
    for e in log:
        e.done = True
    timer.resolve(totals)
    assert steps[0].step_seconds is None and steps[1].step_seconds is None   # dropped: never known
    assert all(s.step_seconds == pytest.approx(0.01) for s in steps[2:])
    assert totals.step_seconds == pytest.approx(0.01 * StepTimer.MAX_PENDING)


def _run(eng, model, x, n):
    for _ in range(n):
        with eng.step():
            model(x).square().sum().backward()


def test_engine_without_a_sync_reports_none_then_the_event_time(monkeypatch):
    """The engine's path for a CUDA step with no budget, on the CPU: the timer is handed fake
    events and told that the step does not synchronize."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(8, 16)
    timer, clock, log = fake_timer()
    monkeypatch.setattr(engine_mod, "begin_timing", lambda eng, budget: eng._timer.begin(True))
    with cs.Chameleon(None, device="cpu") as eng:
        eng._timer = timer
        _run(eng, model, x, 2)
        first, second = eng.history
        assert first.step_seconds is None and second.step_seconds is None
        assert first.host_seconds > 0 and second.host_seconds > 0
        assert eng.totals.step_seconds == 0.0
        assert eng.totals.host_seconds == pytest.approx(first.host_seconds + second.host_seconds)
        assert "step ?" in str(first)
        log[0].t, log[1].t = 0.0, 250.0
        log[0].done = log[1].done = True        # the first step's end has run on the device
        _run(eng, model, x, 1)
        assert first.step_seconds == pytest.approx(0.25)    # updated in place, in history
        assert eng.history[0] is first
        assert second.step_seconds is None
        assert eng.totals.step_seconds == pytest.approx(0.25)
        for e in log:
            e.done = True
    # close() reads what completed since the last step
    assert second.step_seconds is not None and eng.history[2].step_seconds is not None
    assert eng.totals.step_seconds == pytest.approx(sum(s.step_seconds for s in eng.history))


@pytest.mark.parametrize("budget", [None, 10**9])
def test_a_synchronized_step_reports_its_wall_time_at_once(budget):
    """The CPU path (and CUDA with a budget): no events, the measured wall time at once."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    with cs.Chameleon(budget, device="cpu") as eng:
        _run(eng, model, torch.randn(8, 16), 2)
        for s in eng.history:
            assert s.step_seconds is not None and s.step_seconds == s.host_seconds
        assert eng.totals.step_seconds == pytest.approx(sum(s.step_seconds for s in eng.history))
        assert not eng._timer._pending


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_step_without_budget_gets_its_device_time_a_step_late():
    dev = torch.device("cuda")
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).to(dev)
    x = torch.randn(512, 1024, device=dev)
    with cs.Chameleon(None, device=dev) as eng:
        _run(eng, model, x, 3)
        torch.cuda.synchronize(dev)
        _run(eng, model, x, 1)
        first3 = eng.history[:3]
        assert all(s.step_seconds is not None and s.step_seconds > 0 for s in first3)
        assert all(s.host_seconds > 0 for s in eng.history)
        torch.cuda.synchronize(dev)
    last = eng.history[-1]
    assert last.step_seconds is not None and last.step_seconds > 0   # read at close()
    assert eng.totals.step_seconds == pytest.approx(sum(s.step_seconds for s in eng.history))

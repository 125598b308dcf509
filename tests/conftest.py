"""Fixtures shared by the test modules."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """The test models are tiny: intra-op threads buy nothing, and on a small shared machine
    OpenMP threads spinning against the copy workers (and other processes) make steps 10x slower.
    A reference run and the engine's run share the setting, so bitwise comparisons hold. Use it
    per module with ``pytestmark = pytest.mark.usefixtures("one_intra_op_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def plans_land_by_the_next_step(monkeypatch):
    """The planner process's plans land by the step after they were asked for, as they do on an
    idle machine: a test of what plans decide must not hang on how soon a loaded machine runs the
    planner (CI's once answered a replan 11 steps late; a 0.5 s delay per plan failed five such
    tests). tests/policy/test_background.py and test_checks.py's starved planner cover plans
    that come late."""
    from chameleon_swap.policy import background

    def ready(self, ticket):
        s = self._shared
        with s.cond:
            while ticket not in s.done and s.broken is None:
                s.cond.wait()
        return True
    monkeypatch.setattr(background.Worker, "ready", ready)


def pytest_runtest_logreport(report):
    """With ``CHAMELEON_TEST_FAILURES=FILE``, each failure's report is appended to FILE as it
    happens: on a GPU lease the tests run under a time limit, and pytest prints its tracebacks
    only at the end (an H100 run cut at 93% kept the name of a failed test and nothing else)."""
    import os
    path = os.environ.get("CHAMELEON_TEST_FAILURES")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")

"""One size's plan as one call (``plan_size``), and the planner process's loop (``serve``)."""
from __future__ import annotations

import io
import pickle

import pytest

from chameleon_swap.planning.jobs import plan_size, serve
from chameleon_swap.planning.modes import plan_hybrid
from chameleon_swap.planning.quiet import plan_quiet
from chameleon_swap.planning.timeline import unmoved_peak
from _traces import gpu_keep_view
from test_modes import keep_view


def _args(prof, blocks, frac, quiet=False):
    return (prof, blocks, int(unmoved_peak(prof) * frac), None, None, {}, quiet)


def test_plan_size_is_the_quiet_mix_where_asked_and_one_fits_else_the_search():
    prof, blocks = keep_view(n_blocks=4, bw=1e6)          # a link too slow to swap
    budget = int(unmoved_peak(prof) * 0.5)
    assert plan_size(*_args(prof, blocks, 0.5)) == plan_hybrid(prof, blocks, budget)
    quiet = plan_quiet(prof, blocks, budget)
    assert quiet is not None and plan_size(*_args(prof, blocks, 0.5, quiet=True)) == quiet
    # No quiet mix fits a budget below every block's input: the search decides.
    tiny = (prof, blocks, 1, None, None, {}, True)
    assert plan_quiet(prof, blocks, 1) is None
    assert plan_size(*tiny) == plan_hybrid(prof, blocks, 1)


def _served(*jobs) -> list:
    inp = io.BytesIO(b"".join(pickle.dumps(j) for j in jobs))
    out = io.BytesIO()
    serve(inp, out)                      # returns at the end of its input
    out.seek(0)
    answers = []
    while out.tell() < len(out.getvalue()):
        answers.append(pickle.load(out))
    return answers


@pytest.mark.parametrize("name", ["h4096-unreached-16384", "h4096-b10GiB-model-16384"])
def test_serve_answers_each_job_with_what_the_call_returns(name):
    # The GPU's own traces (an H100, 16k tokens): the plan that comes back through the pipe
    # format is the one made in-process, field for field.
    prof, blocks = gpu_keep_view(name)
    a, b = _args(prof, blocks, 0.25), _args(prof, blocks, 0.5, quiet=True)
    answers = _served((7, "plan_size", a), (8, "plan_size", b))
    assert [t for t, *_ in answers] == [7, 8]
    assert all(ok and seconds > 0 for _, seconds, ok, _ in answers)
    assert answers[0][3] == plan_size(*a) and answers[1][3] == plan_size(*b)


def test_a_failing_job_is_answered_with_its_error_and_the_next_still_runs():
    prof, blocks = keep_view()
    good = _args(prof, blocks, 0.5)
    (t1, _, ok1, err), (t2, _, ok2, plan) = _served((1, "plan_size", (prof,)),
                                                    (2, "plan_size", good))
    assert (t1, ok1) == (1, False) and "TypeError" in err and "plan_size" in err
    assert (t2, ok2) == (2, True) and plan == plan_size(*good)

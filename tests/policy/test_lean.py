"""The lean path (policy/lean.py, runtime/resident.py): with ``model=``, a size the budget holds
whole runs its later steps on the hooks of an engine that never moves, bit for bit and within
the budget; a step that outgrows the budget trips back to the executor's path and still holds
it; a size that had to move much after a trip goes back to the executor's path until an all-kept
step there shows it fits again."""
from __future__ import annotations

import copy
import statistics
from unittest import mock

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chameleon_swap as cs
from chameleon_swap.policy import lean
from chameleon_swap.policy.lean import SLACK, LeanSizes

from _helpers import compare, natural_peak, train_beside, train_step
from _models import SPEC_BLOCKS, TBlock, lm_batches, randn, random_model, tiny_llama

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")   # see conftest.py

SLOW = "10MB/s"


class Grows(nn.Module):
    """``n`` blocks, then ``extra`` elementwise steps after them: a step of the same size (the
    first block's input) that saves more than the steps before it."""

    def __init__(self, n: int = 3, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(TBlock(dim, 0.0) for _ in range(n))
        self.extra = 0

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        for _ in range(self.extra):
            x = x * torch.sigmoid(x)
        return x.square().mean()


@pytest.mark.parametrize("blocks", [True, False], ids=["model", "no-model"])
def test_a_size_the_budget_holds_runs_lean_from_its_second_step(blocks):
    """With model=, lean from the first block on; without, from the step's second saved
    storage (its first, the token ids, keys its size)."""
    model = tiny_llama(n_layers=3)
    batches = lm_batches(model, [16, 16, 24, 16, 24, 24])
    history, _, budget = compare(model, batches, lambda peaks: 2 * max(peaks),
                                 model_kwarg=blocks, link_bandwidth=SLOW)
    assert [s.lean for s in history] == ["", "whole", "", "whole", "whole", "whole"]
    for s in history:
        assert s.block_modes == ((3, 0, 0) if blocks else ()) and s.offloaded_bytes == 0
        assert s.recomputed_bytes == 0
    lean = [s for s in history if s.lean]
    assert all(s.plan_source == "cache" for s in lean)
    # A lean step records no sequence: it, and the step after it, compare sizes (a new size
    # is a new sequence), as the executor's path compares sequences.
    assert [s.sequence_changed for s in history] == [False, False, True, True, True, False]
    # Predicted from the size's lean steps before it: none for a size's first.
    assert [s.predicted_step_seconds is None for s in lean] == [True, False, True, False]
    # The same figures as the executor's path: what a step saves, and its peak.
    assert history[1].saved_bytes == history[0].saved_bytes
    assert history[1].peak_resident_bytes == history[0].peak_resident_bytes
    assert history[3].saved_bytes == history[1].saved_bytes


def test_a_lean_record_never_moves():
    model = tiny_llama(n_layers=3)
    batch = lm_batches(model, [16])[0]
    with cs.Chameleon(10**9, device="cpu", model=model, link_bandwidth=SLOW,
                      min_tensor_bytes=0) as eng:
        train_step(model, batch, eng)
        with eng.step():
            loss = model(*batch)
            ex = eng._ex
            lean = [r for r in list(ex.live) if not r.handles]
            assert lean and ex.lean
            for rec in lean:
                assert ex.offload(rec) is False and rec.state == "resident"
            loss.backward()
        assert eng.last_step.lean == "whole" and not eng._runner.lean   # (per step)
        assert eng.records_alive == 0 and eng.resident_bytes == 0


def test_a_write_in_place_to_a_lean_save_raises_as_without_the_engine():
    """LESSONS 11 on a lean step: autograd checks no version of a hooked saved tensor, the lean
    hooks do (the first block's output, saved by the second block's layer norm, changed in place
    after the forward)."""
    model = Grows()
    x = randn(2, 24, 16, seed=3)
    kept = []
    model.layers[0].register_forward_hook(lambda m, a, out: kept.append(out))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss = model(x)
        kept[-1].add_(1.0)
        loss.backward()
    with cs.Chameleon(10**9, device="cpu", model=model, link_bandwidth=SLOW) as eng:
        train_step(model, x, eng)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            with eng.step():
                loss = model(x)
                assert eng._lean_step
                kept[-1].add_(1.0)
                loss.backward()
        assert eng.last_step.failed and eng.last_step.lean == "whole"
        del loss
        kept.clear()
        assert eng.records_alive == 0 and eng.resident_bytes == 0


def _grows_run(extras: list, budget_of, n: int = 3, link: dict = None,
               blocks: bool = True) -> tuple:
    """Train ``Grows(n)`` with and without the engine, one step per entry of ``extras`` (its
    ``extra`` that step); the budget is ``budget_of(saved bytes of a step with extra=0)``;
    ``link``: the engine's link arguments (default: ``link_bandwidth=SLOW``); ``blocks``: the
    engine is given the model."""
    model, ref = Grows(n), Grows(n)
    x = randn(2, 24, 16, seed=3)
    budget = budget_of(natural_peak(model, x, lambda m, b: m(b)))
    out = []
    with cs.Chameleon(budget, device="cpu", model=model if blocks else None, min_tensor_bytes=0,
                      **(link or {"link_bandwidth": SLOW})) as eng:
        for extra in extras:
            model.extra = ref.extra = extra
            train_beside(model, ref, [x], eng, budget)
            out.append(eng.last_step)
        return out, budget, eng._policy.modes.lean_sizes


@pytest.mark.parametrize("blocks", [True, False], ids=["model", "no-model"])
@pytest.mark.parametrize("link", [None, {"emulate_link": "20MB/s"}], ids=["planned", "emulated"])
def test_a_step_that_outgrows_its_size_trips_and_holds_the_budget(link, blocks):
    """On the emulated link too: the trip's copies take the link's time, and the step waits
    for them where the budget needs their bytes (the real clock's twin)."""
    steps, budget, sizes = _grows_run([0, 0, 6, 6, 0, 0, 0], lambda peak: int(peak * 1.01),
                                      link=link, blocks=blocks)
    assert [s.lean for s in steps[:3]] == ["", "whole", "tripped"]
    trip = steps[2]
    assert trip.plan_source == "guard" and trip.offloaded_bytes > budget * SLACK
    if link is not None:
        assert trip.forced_offloads + trip.budget_waits > 0 and trip.stall_seconds > 0
    # It had to move that much: back on the executor's path, whose plans move early ...
    assert steps[3].lean == ""
    # ... until an all-kept step there shows the size fits again (steps 4 and on).
    assert steps[4].lean == "" and steps[4].block_modes == ((3, 0, 0) if blocks else ())
    assert [s.lean for s in steps[5:]] == ["whole", "whole"]
    assert sizes.fits


def test_a_size_just_over_the_budget_runs_lean_and_trips_at_its_end():
    """Within ``SLACK`` over the budget (the emulated-link benchmark's 384 tokens at 75%, 5 bytes
    over): lean, tripping near the forward's end, what the trip moves being the step's first
    saves or, where it saved none before its first block (this model), the save that trips
    it (one of 96 here); the size stays lean."""
    steps, budget, _ = _grows_run([0] * 5, lambda peak: peak - 64, n=6)
    assert steps[0].lean == "" and steps[0].offloaded_bytes > 0
    assert [s.lean for s in steps[1:]] == ["tripped"] * 4
    assert all(0 < s.offloaded_bytes <= budget * SLACK for s in steps[1:])


def test_lean_sizes_by_hand():
    class Call:
        def __init__(self, mode: str) -> None:
            self.mode = mode

    class Ex:
        def __init__(self, budget, saved) -> None:
            self.budget, self._earlier = budget, set()
            self.stats = type("S", (), {"saved_bytes": saved})()

    sizes = LeanSizes()
    sizes.learn(7, Ex(1000, 1010), [Call("keep")] * 3)
    assert not sizes.wants(7, 1000)                   # not on: the engine cannot run lean steps
    sizes.on = True
    assert sizes.wants(7, 1000) and not sizes.wants(7, 980) and not sizes.wants(8, 1000)
    sizes.learn(7, Ex(1000, 2000), [Call("keep"), Call("full")])   # not all kept: not learnt
    sizes.learn(7, Ex(None, 2000), [Call("keep")] * 3)             # no budget: not learnt
    sizes.learn(9, Ex(1000, 900))                                  # no blocks (no model=)
    assert sizes.fits == {7: 1010, 9: 900}
    assert sizes.predicted(7) is None
    for s in (0.3, 0.1, 0.2, 0.4):
        sizes.ran(7, s, 0, 1000)
    assert sizes.predicted(7) == 0.2                  # the low median of the last three
    sizes.ran(7, 0.5, int(1000 * SLACK), 1000)        # moved SLACK of the budget: stays
    assert sizes.wants(7, 1000)
    sizes.ran(7, 0.5, int(1000 * SLACK) + 1, 1000)    # more: back to the executor's path
    assert not sizes.wants(7, 1000) and 7 not in sizes.fits


@pytest.mark.parametrize("kw", [dict(budget=None), dict(budget=10**9, trace_dir=True),
                                dict(budget=10**9, policy="static")],
                         ids=["no-budget", "traced", "static"])
def test_no_lean_steps_without_a_budget_with_a_trace_or_on_the_static_policy(kw, tmp_path):
    """No budget: nothing would gain (blocks keep, the executor's path with no budget is cheap
    already); a trace needs every save timed; the static policy is the frozen-schedule peers'
    baseline, as they run."""
    if kw.get("trace_dir"):
        kw = {**kw, "trace_dir": tmp_path}
    model = tiny_llama(n_layers=3)
    with cs.Chameleon(device="cpu", model=model, link_bandwidth=SLOW, **kw) as eng:
        for b in lm_batches(model, [16, 16, 16]):
            train_step(model, b, eng)
        assert not eng._lean_ok and [s.lean for s in eng.history] == ["", "", ""]



@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.fixed_dictionaries({
           "blocks": st.lists(st.sampled_from(SPEC_BLOCKS), min_size=2, max_size=5),
           "dim": st.sampled_from([4, 8]), "seed": st.integers(0, 2**16)}),
       lengths=st.lists(st.sampled_from([3, 5, 8]), min_size=3, max_size=7),
       fraction=st.floats(0.9, 1.05), slack=st.sampled_from([SLACK, 1.0]),
       link=st.sampled_from([SLOW, "1TB/s"]))
def test_random_models_bitwise_and_within_budget_on_and_off_the_lean_path(spec, lengths,
                                                                           fraction, slack, link):
    """Budgets about the size of a step (lengths that recur, so sizes go lean; a budget between
    the lengths' footprints, so some fit, some never run lean); with a slack of 100% (a size up
    to twice its budget runs lean) and a fast link (sizes over the budget keep every block and
    swap, so their fit is learnt), lean steps trip, at every point of their step."""
    model = random_model(spec)
    ref = copy.deepcopy(model)
    inputs = [(randn(2, T, spec["dim"], seed=i),) for i, T in enumerate(lengths)]
    budget = int(statistics.median(natural_peak(model, b) for b in inputs) * fraction)
    with mock.patch.object(lean, "SLACK", slack), \
            cs.Chameleon(budget, device="cpu", min_tensor_bytes=0, model=model,
                         blocks=list(model.blocks), link_bandwidth=link) as eng:
        train_beside(model, ref, inputs, eng, budget)

"""The engine end to end on CPU: bitwise losses and gradients, the budget (checked independently
of the engine's own counter), StepStats, and the lifecycle of steps and engines."""
from __future__ import annotations

import copy
import dataclasses
import weakref
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import chameleon_swap as cs
from chameleon_swap.runtime import step_end

from _helpers import assert_bitwise, compare, grads, natural_peak, train_step
from _models import (SPEC_BLOCKS, FunctionalModel, ViewsModel, lm_batches, randn, random_model,
                     tiny_llama, tiny_moe)
from _models import tokens as _tokens

FRACTIONS = [1.0, 0.5, 0.2, 0.05, 0.0]
POLICIES = ["guard", "chameleon", "static"]     # every policy, whichever is the default


def tokens(cfg, B, T, seed):
    return _tokens(cfg.vocab_size, B, T, seed)


llama, moe = tiny_llama, tiny_moe


def dense_batches(lengths, B=2, dim=16):
    return [(randn(B, T, dim, seed=i),) for i, T in enumerate(lengths)]


# name -> (model factory, batches factory)
MODELS = {
    "llama": (llama, lambda m: lm_batches(m, [12, 20])),
    "moe": (moe, lambda m: lm_batches(m, [12, 20, 7])),
    "views": (ViewsModel, lambda m: dense_batches([6, 11])),
    "functional": (FunctionalModel, lambda m: dense_batches([6, 11])),
}


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")   # see conftest.py


def engine(budget, **kw):
    kw.setdefault("min_tensor_bytes", 0)
    return cs.Chameleon(budget, device="cpu", **kw)


def param_storages(model):
    return [p.untyped_storage() for _, p in model.named_parameters()]


# --------------------------------------------------------------------------- bitwise equality
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("name", list(MODELS))
def test_bitwise_under_budget(name, fraction, policy):
    make, make_batches = MODELS[name]
    model = make()
    batches = make_batches(model)
    history, peaks, budget = compare(model, batches, fraction, policy=policy)
    assert len(history) == len(batches)
    assert all(s.budget_bytes == budget for s in history)
    if fraction < 1.0:
        assert sum(s.offloaded_bytes for s in history) > 0  # the budget really forced moves
    if fraction == 0.0:
        assert all(s.peak_resident_bytes == 0 for s in history)


def test_moe_routing_differs_between_batches():
    """The MoE cases above mean something only if routing (and so the saved tensors) changes."""
    model = moe()
    counts = []
    for b in lm_batches(model, [12, 20, 7]):
        with torch.no_grad():
            model(*b)
        counts.append(tuple(model.last_expert_counts))
    assert len(set(counts)) == len(counts)


def test_functional_model_fires_no_module_hook():
    model = FunctionalModel()
    batches = dense_batches([6])
    ref = copy.deepcopy(model)
    with engine(int(natural_peak(model, batches[0]) * 0.3)) as eng:
        # The module hooks report every module call to the profiler; no module, no call. (The
        # hooks themselves are bound at creation, so the profiler is where a spy can see them.)
        fired = []
        prof = eng._profiler
        enter, leave = prof.module_enter, prof.module_exit
        prof.module_enter = lambda m: (fired.append(m), enter(m))
        prof.module_exit = lambda m: (fired.append(m), leave(m))
        loss = train_step(model, batches[0], eng)
        assert fired == []
        assert eng.last_step.offloaded_bytes > 0
        assert eng.last_step.prefetched_bytes + eng.last_step.fetched_bytes > 0
    l_ref = train_step(ref, batches[0])
    assert_bitwise(l_ref, grads(ref), loss, grads(model))


@pytest.mark.parametrize("fraction", [0.3, 0.0])
@pytest.mark.parametrize("make", [llama, moe], ids=["llama", "moe"])
def test_sequence_length_varies_per_step(make, fraction):
    model = make()
    batches = lm_batches(model, [16, 40, 8, 33])
    history, peaks, budget = compare(model, batches, fraction)
    assert len(set(peaks)) == 4                   # every step saves a different amount
    assert [s.step for s in history] == [0, 1, 2, 3]
    assert all(s.budget_bytes == budget and s.peak_resident_bytes <= budget for s in history)


# --------------------------------------------------------------------------- moved bytes
@pytest.mark.parametrize("fraction", [0.5, 0.2, 0.0])
@pytest.mark.parametrize("name", list(MODELS))
def test_offloaded_bytes_cover_what_the_budget_requires(name, fraction):
    make, make_batches = MODELS[name]
    model = make()
    batch = make_batches(model)[-1]
    peak = natural_peak(model, batch)
    budget = int(peak * fraction)
    with engine(budget) as eng:
        train_step(model, batch, eng)
        st_ = eng.last_step
    assert st_.saved_bytes == peak
    assert st_.offloaded_bytes >= peak - budget, st_
    assert st_.peak_resident_bytes <= budget
    # Everything that went out and was needed came back (nothing is read from a stale copy).
    # (or was needed before its copy-out completed, and the device copy was used: kept_bytes).
    assert st_.prefetched_bytes + st_.fetched_bytes + st_.kept_bytes \
        >= st_.offloaded_bytes - (peak - st_.saved_bytes)


def test_budget_none_moves_nothing():
    model = llama()
    batch = lm_batches(model, [24])[0]
    ref = copy.deepcopy(model)
    with engine(None) as eng:
        loss = train_step(model, batch, eng)
        s = eng.last_step
    assert s.budget_bytes is None
    assert s.offloaded_bytes == s.offloaded_tensors == 0
    assert s.prefetched_bytes == s.fetched_bytes == s.sync_fetches == 0
    assert s.host_peak_bytes == 0
    assert s.peak_resident_bytes == s.saved_bytes > 0
    assert_bitwise(train_step(ref, batch), grads(ref), loss, grads(model))


COPY_METHODS = ("record_ready", "offload", "fetch", "wait", "wait_host", "defer", "poll")


def spy_copy_engine(eng, monkeypatch) -> Counter:
    """Count every call the step makes into the engine's copy engine, by method."""
    calls = Counter()
    for name in COPY_METHODS:
        def spy(*args, _real=getattr(eng._copy, name), _name=name, **kw):
            calls[_name] += 1
            return _real(*args, **kw)
        monkeypatch.setattr(eng._copy, name, spy)
    return calls


@pytest.mark.parametrize("policy", POLICIES)
def test_budget_none_takes_no_ready_marker_and_makes_no_copy_call_per_save(policy, monkeypatch):
    """With no budget nothing can move: no "bytes are final" marker per save (a CUDA event and a
    stream lookup each), no poll per pack or unpack, no backward trigger per module; the
    gradients are still bit for bit, and so are the accounting figures."""
    model, ref = llama(), llama()
    batches = lm_batches(model, [12, 20, 12])
    with engine(None, policy=policy) as eng:
        calls = spy_copy_engine(eng, monkeypatch)
        triggers = Counter()
        real_trigger = eng._ex.backward_trigger
        monkeypatch.setattr(eng._ex, "backward_trigger",
                            lambda grad=None: triggers.update(["trigger"]) or real_trigger(grad))
        for b in batches:
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            loss = train_step(model, b, eng)
            assert_bitwise(train_step(ref, b), grads(ref), loss, grads(model))
            s = eng.last_step
            assert s.saved_bytes > 0 and s.peak_resident_bytes == s.saved_bytes
            assert s.offloaded_bytes == s.prefetched_bytes == s.fetched_bytes == 0
        assert sum(calls.values()) == 0, dict(calls)      # (close() below synchronizes it)
        assert not triggers


@pytest.mark.parametrize("policy", POLICIES)
def test_with_a_budget_every_record_gets_its_marker_at_save(policy, monkeypatch):
    """The same model under a budget it never reaches: one marker per record, taken at save
    (on CUDA the copy stream must wait on an event recorded then, whichever stream ran)."""
    model = llama()
    b = lm_batches(model, [12])[0]
    with engine(10**12, policy=policy) as eng:
        calls = spy_copy_engine(eng, monkeypatch)
        train_step(model, b, eng)
        n_records = len(eng._profiler.last_profile.keys)
    assert n_records > 0 and calls["record_ready"] == n_records
    assert calls["offload"] == calls["fetch"] == 0


@pytest.mark.parametrize("traced", [False, True], ids=["resident-only", "executor-path"])
def test_a_record_saved_with_no_budget_refuses_to_move(traced, tmp_path):
    """Such a record has no ready marker; moving it could copy bytes not yet written on CUDA, so
    the executor refuses (no policy asks: they move only records of a step with a budget). On
    the executor's path (a traced engine's) it raises; a record of the lean path (an engine that
    never moves) has no handles to move it through, and ``offload`` declines it."""
    with engine(None, trace_dir=tmp_path if traced else None) as eng:
        x = torch.randn(4, 8, requires_grad=True)
        with eng.step():
            y = (x * 2).tanh()
            rec = next(iter(eng._ex.live))
            if traced:
                with pytest.raises(RuntimeError, match="no budget"):
                    eng._ex.offload(rec)
            else:
                assert eng._ex.offload(rec) is False
            assert rec.state == "resident"
            y.sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    (x_ref * 2).tanh().sum().backward()
    assert torch.equal(x.grad, x_ref.grad)                 # the refusal changed nothing


@pytest.mark.parametrize("budget, trace, synced", [(None, False, False), (10**12, False, True),
                                                   (0, False, True), (None, True, True)])
def test_the_step_end_waits_for_the_device_only_when_a_figure_needs_it(
        budget, trace, synced, tmp_path, monkeypatch):
    """On CUDA the end of a step synchronizes for a budget (the planner scales its estimates by
    the device-inclusive step time; stalls are read from events) or a timed step (its event
    times); with no budget the host goes on. The decision is the same code on every device."""
    model = llama()
    b = lm_batches(model, [12])[0]
    with engine(budget, trace_dir=tmp_path if trace else None) as eng:
        syncs = []
        monkeypatch.setattr(step_end, "sync_device", lambda device: syncs.append(eng._profiler.detailed))
        for _ in range(3):
            train_step(model, b, eng)
    assert len(syncs) == (3 if synced else 0)
    if trace:
        assert all(syncs)                      # traced steps are timed: the reason to wait


# --------------------------------------------------------------------------- independent residency
class PackSpy:
    """Wraps the executor's pack hook and the copy engine's fetch, and remembers a weak reference
    to every saved storage and to every device buffer a copy back writes into.

    It measures residency without the engine's help: a storage still alive after forward (and
    not a parameter) is held on the "device" by someone, and in a model whose forward returns
    only the loss, with an input nobody else keeps, that someone can only be the engine/autograd.
    (Planned policies may start copies back as forward ends, before backward: those buffers are
    on the device too.)
    """

    def __init__(self, eng, exclude):
        self.refs = []
        self.exclude = exclude               # strong refs to parameter storages
        self._pack = eng._ex.pack
        eng._ex.pack = self                  # step() looks the hook up on each entry
        self._fetch = eng._copy.fetch
        eng._copy.fetch = self._spied_fetch  # the executor calls its copy engine's fetch

    def __call__(self, t):
        self.refs.append(weakref.ref(t.untyped_storage()))
        return self._pack(t)

    def _spied_fetch(self, src, after):
        dst, ticket = self._fetch(src, after)
        self.refs.append(weakref.ref(dst.untyped_storage()))
        return dst, ticket

    def alive_bytes(self) -> int:
        alive = {}
        for r in self.refs:
            s = r()
            if s is not None and not any(s is p for p in self.exclude):
                alive[id(s)] = s.nbytes()    # only live objects: their ids are distinct
        return sum(alive.values())


def spied_step(model, make_input, eng, spy, budget):
    """Forward (input made inline, so only autograd holds it), check residency independently,
    then backward. Returns the loss."""
    with eng.step():
        loss = model(make_input())
        # Copies out may still be in flight: those storages are alive and also still counted
        # by the engine (a tensor being copied out counts until its copy completes), so compare
        # at a quiet point: wait for every copy and run the completion callbacks, which drop
        # the device side of each finished copy-out.
        eng._copy.synchronize()
        eng._ex.copy.poll()
        alive = spy.alive_bytes()
        assert alive == eng.resident_bytes, (alive, eng.resident_bytes)
        if budget is not None:
            assert alive <= budget, (alive, budget)
        loss.backward()
    return loss.detach()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fraction", [None, 1.0, 0.5, 0.2, 0.0])
@pytest.mark.parametrize("kind", ["views", "functional", "random"])
def test_residency_cross_check(kind, fraction, policy):
    if kind == "views":
        model, shape = ViewsModel(), (2, 9, 16)
    elif kind == "functional":
        model, shape = FunctionalModel(), (2, 9, 16)
    else:
        model, shape = random_model({"blocks": list(SPEC_BLOCKS) * 2, "dim": 8, "seed": 3}), (2, 7, 8)
    ref = copy.deepcopy(model)
    make_input = lambda: randn(*shape, seed=5)  # noqa: E731
    peak = natural_peak(model, (make_input(),))
    budget = None if fraction is None else int(peak * fraction)
    with engine(budget, policy=policy) as eng:
        spy = PackSpy(eng, param_storages(model))
        for _ in range(3):                       # later steps on warm pool/policy/plan state
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            loss = spied_step(model, make_input, eng, spy, budget)
            assert_bitwise(train_step(ref, (make_input(),)), grads(ref), loss, grads(model))
            assert eng.host_bytes_in_use == 0 and eng.resident_bytes == 0
            assert spy.alive_bytes() == 0        # nothing saved outlives its graph


# --------------------------------------------------------------------------- property test
def _spec():
    return st.fixed_dictionaries({
        "blocks": st.lists(st.sampled_from(SPEC_BLOCKS), min_size=1, max_size=6),
        "dim": st.sampled_from([2, 4, 8]),
        "seed": st.integers(0, 2**16),
    })


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_spec(),
       shapes=st.lists(st.tuples(st.integers(1, 2), st.integers(1, 6)), min_size=1, max_size=3),
       fraction=st.one_of(st.none(), st.floats(0.0, 1.2)),
       min_tensor_bytes=st.sampled_from([0, 64, 2**20]),
       policy=st.sampled_from(POLICIES))
# Found by this test: a frozen plan starts a copy back as forward ends (the cross-check must see
# copy-back buffers too).
@example(spec={"blocks": ["linear", "layernorm"], "dim": 2, "seed": 0},
         shapes=[(1, 2), (1, 4), (1, 2)], fraction=0.5, min_tensor_bytes=0, policy="static")
def test_random_models_bitwise_and_budget(spec, shapes, fraction, min_tensor_bytes, policy):
    model = random_model(spec)
    ref = copy.deepcopy(model)
    dim = spec["dim"]
    inputs = [(lambda s=s, i=i: randn(s[0], s[1], dim, seed=i)) for i, s in enumerate(shapes)]
    peaks = [natural_peak(model, (f(),)) for f in inputs]
    budget = None if fraction is None else int(min(peaks) * fraction)
    with engine(budget, min_tensor_bytes=min_tensor_bytes, policy=policy) as eng:
        spy = PackSpy(eng, param_storages(model))
        for f in inputs:
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            loss = spied_step(model, f, eng, spy, budget)
            assert_bitwise(train_step(ref, (f(),)), grads(ref), loss, grads(model))
            s = eng.last_step
            if budget is not None:
                assert s.peak_resident_bytes <= budget, s
            else:
                assert s.offloaded_bytes == 0
            assert eng.host_bytes_in_use == 0 and eng.resident_bytes == 0


# --------------------------------------------------------------------------- StepStats
def test_step_stats_fields_history_and_round_trip():
    model = llama()
    batches = lm_batches(model, [10, 18, 6])
    budget = int(min(natural_peak(model, b) for b in batches) * 0.4)
    with engine(budget) as eng:
        assert eng.last_step is None and eng.history == []
        for i, b in enumerate(batches):
            train_step(model, b, eng)
            assert len(eng.history) == i + 1
            assert eng.last_step is eng.history[-1]
            assert eng.last_step.step == i
        for s in eng.history:
            assert isinstance(s, cs.StepStats)
            names = {f.name for f in dataclasses.fields(s)}
            assert {"step", "budget_bytes", "peak_resident_bytes", "saved_bytes", "offloaded_bytes",
                    "offloaded_tensors", "prefetched_bytes", "fetched_bytes", "sync_fetches",
                    "late_prefetches", "budget_waits", "stall_seconds", "step_seconds",
                    "host_peak_bytes", "skipped_bytes", "peak_device_bytes", "failed"} <= names
            assert s.budget_bytes == eng.budget_bytes == budget
            for f in ("peak_resident_bytes", "saved_bytes", "offloaded_bytes", "offloaded_tensors",
                      "prefetched_bytes", "fetched_bytes", "sync_fetches", "late_prefetches",
                      "budget_waits", "host_peak_bytes", "skipped_bytes"):
                v = getattr(s, f)
                assert type(v) is int and v >= 0, (f, v)
            for f in ("stall_seconds", "step_seconds"):
                v = getattr(s, f)
                assert isinstance(v, float) and v >= 0.0, (f, v)
            assert s.stall_seconds <= s.step_seconds
            assert s.peak_device_bytes is None            # CPU, no device_memory_limit
            assert s.failed is False
            assert 0 < s.peak_resident_bytes <= budget < s.saved_bytes
            assert s.offloaded_tensors > 0 and s.offloaded_bytes > 0
            assert s.late_prefetches <= s.sync_fetches
            assert s.host_peak_bytes >= 0 and s.skipped_bytes > 0  # weights saved by matmuls
            text = str(s)
            assert "\n" not in text and text.startswith(f"step {s.step}")
            d = s.as_dict()
            assert isinstance(d, dict) and set(d) == names
            assert cs.StepStats(**d) == s
        steps = [s.step for s in eng.history]
        assert steps == sorted(steps) == list(range(len(batches)))


# --------------------------------------------------------------------------- step semantics
def _one_step_budget(model, batch, fraction=0.3):
    return int(natural_peak(model, batch) * fraction)


def test_nested_step_raises_and_outer_step_still_works():
    model = llama()
    ref = copy.deepcopy(model)
    batch = lm_batches(model, [12])[0]
    with engine(_one_step_budget(model, batch)) as eng:
        with eng.step():
            with pytest.raises(RuntimeError, match="nested"):
                with eng.step():
                    pass
            loss = model(*batch)
            loss.backward()
        assert len(eng.history) == 1 and not eng.last_step.failed
        assert eng.last_step.offloaded_bytes > 0
    assert_bitwise(train_step(ref, batch), grads(ref), loss.detach(), grads(model))


@pytest.mark.parametrize("fraction", [1.0, 0.3, 0.0])
def test_exception_inside_step_releases_and_next_step_works(fraction):
    model = llama()
    ref = copy.deepcopy(model)
    batch = lm_batches(model, [12])[0]
    with engine(_one_step_budget(model, batch, fraction)) as eng:
        with pytest.raises(ValueError, match="boom"):
            with eng.step():
                loss = model(*batch)
                raise ValueError("boom")
        assert eng.last_step.failed is True
        assert eng.last_step.step == 0
        assert eng.resident_bytes == 0
        # The graph of the failed step is still referenced; its saved tensors were released, so
        # backward through it must fail loudly rather than read freed memory.
        with pytest.raises(RuntimeError):
            loss.backward()
        del loss
        assert eng.host_bytes_in_use == 0 and eng.resident_bytes == 0
        # The next step is a normal one.
        model.zero_grad(set_to_none=True)
        loss = train_step(model, batch, eng)
        assert eng.last_step.failed is False and eng.last_step.step == 1
        assert eng.host_bytes_in_use == 0
    assert_bitwise(train_step(ref, batch), grads(ref), loss, grads(model))


def test_exception_during_backward_releases_and_next_step_works():
    model = ViewsModel()
    ref = copy.deepcopy(model)
    batch = dense_batches([9])[0]
    with engine(_one_step_budget(model, batch, 0.2)) as eng:
        with pytest.raises(ZeroDivisionError):
            with eng.step():
                loss = model(*batch)
                loss.register_hook(lambda g: 1 / 0)
                loss.backward()
        assert eng.last_step.failed is True
        del loss
        assert eng.host_bytes_in_use == 0 and eng.resident_bytes == 0
        model.zero_grad(set_to_none=True)
        loss = train_step(model, batch, eng)
        assert not eng.last_step.failed
    assert_bitwise(train_step(ref, batch), grads(ref), loss, grads(model))


@pytest.mark.parametrize("drop_inside", [True, False], ids=["dropped-in-step", "dropped-after"])
def test_forward_without_backward_releases_everything(drop_inside):
    model = llama()
    ref = copy.deepcopy(model)
    batch = lm_batches(model, [16])[0]
    budget = _one_step_budget(model, batch, 0.3)
    with engine(budget) as eng:
        with eng.step():
            loss = model(*batch)                 # an eval-like step: no backward
            assert eng.resident_bytes <= budget
            if drop_inside:
                del loss
        assert not eng.last_step.failed
        assert eng.last_step.offloaded_bytes > 0
        if not drop_inside:
            del loss
        assert eng.host_bytes_in_use == 0 and eng.resident_bytes == 0
        loss = train_step(model, batch, eng)
        assert eng.last_step.peak_resident_bytes <= budget
        assert eng.host_bytes_in_use == 0 and eng.resident_bytes == 0
    assert_bitwise(train_step(ref, batch), grads(ref), loss, grads(model))


def test_backward_after_the_step_block():
    model = ViewsModel()
    ref = copy.deepcopy(model)
    batch = dense_batches([10])[0]
    budget = _one_step_budget(model, batch, 0.2)
    with engine(budget) as eng:
        with eng.step():
            loss = model(*batch)
        assert eng.last_step.offloaded_bytes > 0
        loss.backward()                          # the graph was kept across the step's exit
        assert eng.resident_bytes == 0
        del loss
        assert eng.host_bytes_in_use == 0
        got = grads(model)
        # And the engine is still usable for the next step.
        model.zero_grad(set_to_none=True)
        loss2 = train_step(model, batch, eng)
    l_ref = train_step(ref, batch)
    assert_bitwise(l_ref, grads(ref), loss2, grads(model))
    assert_bitwise(l_ref, grads(ref), l_ref, got)


def test_close_releases_and_step_after_close_raises():
    model = llama()
    batch = lm_batches(model, [16])[0]
    eng = engine(_one_step_budget(model, batch, 0.2))
    with eng.step():
        loss = model(*batch)                     # graph kept across close()
    assert eng.host_bytes_in_use > 0
    with eng.step():
        with pytest.raises(RuntimeError, match="inside"):
            eng.close()
    eng.close()
    assert eng.host_bytes_in_use == 0 and eng.resident_bytes == 0
    with pytest.raises(RuntimeError):
        loss.backward()                          # its saved tensors were released
    with pytest.raises(RuntimeError, match="closed"):
        with eng.step():
            pass
    eng.close()                                  # idempotent


def test_context_manager_closes():
    model = ViewsModel()
    batch = dense_batches([8])[0]
    with engine(_one_step_budget(model, batch, 0.3)) as eng:
        assert isinstance(eng, cs.Chameleon)
        train_step(model, batch, eng)
    assert eng.host_bytes_in_use == 0
    with pytest.raises(RuntimeError, match="closed"):
        with eng.step():
            pass


def test_context_manager_closes_on_exception():
    with pytest.raises(KeyError):
        with engine(0) as eng:
            with eng.step():
                raise KeyError("x")
    assert eng.last_step.failed
    with pytest.raises(RuntimeError, match="closed"):
        with eng.step():
            pass


# --------------------------------------------------------------------------- min_tensor_bytes
def test_large_min_tensor_bytes_and_room_in_budget_moves_nothing():
    model = llama()
    batch = lm_batches(model, [16])[0]
    peak = natural_peak(model, batch)
    for budget in (None, peak):
        history, _, _ = compare(model, [batch], None if budget is None else 1.0,
                                min_tensor_bytes=2**40)
        assert history[-1].offloaded_bytes == 0, history[-1]
        assert history[-1].peak_resident_bytes == peak


@pytest.mark.parametrize("fraction", [0.5, 0.1, 0.0])
def test_small_tensors_move_when_the_budget_needs_it(fraction):
    model = llama()
    batches = lm_batches(model, [16, 24])
    # Every storage is "small": the guard must still move them to hold the budget.
    history, peaks, budget = compare(model, batches, fraction, min_tensor_bytes=2**40)
    assert budget < min(peaks)
    for s in history:
        assert s.peak_resident_bytes <= budget
        assert s.offloaded_bytes >= s.saved_bytes - budget > 0


def test_one_info_line_per_step_on_the_chameleon_swap_logger(caplog):
    """The README's logging section: one INFO record per step on the ``chameleon_swap`` logger,
    the step's StepStats as text."""
    import logging
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    with caplog.at_level(logging.INFO, logger="chameleon_swap"):
        with cs.Chameleon(1024, device="cpu", min_tensor_bytes=0) as eng:
            for _ in range(2):
                with eng.step():
                    model(torch.randn(8, 32)).sum().backward()
    records = [r for r in caplog.records if r.name == "chameleon_swap"]
    assert [r.levelno for r in records] == [logging.INFO] * 2
    assert [r.getMessage() for r in records] == [str(s) for s in eng.history]

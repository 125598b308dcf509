"""The engine's global module hooks (runtime/module_hooks.py): which module calls they tell the
engine about."""
from __future__ import annotations

import copy
import gc

import pytest
import torch

import chameleon_swap as cs
from chameleon_swap.runtime import module_hooks
from _helpers import assert_bitwise, grads, natural_peak, train_beside
from _models import TBlock, TModel, randn


class _Progress:
    """Stands in for a device_memory_limit's reader (CUDA only): counts the calls it sees."""

    def __init__(self) -> None:
        self.calls = 0

    def on_progress(self, saved_bytes: int):
        self.calls += 1
        return None


@pytest.mark.parametrize("mode,limit", [("full", False), ("selective", False), ("keep", False),
                                        ("full", True)])
def test_modules_inside_a_checkpointed_block_forward_are_not_events(monkeypatch, mode, limit):
    # Their saves go to checkpoint, never through the engine: the engine skips their calls
    # (about half of a Llama's module calls). The block's own call is still one; a kept block's
    # modules still are; gradients are the plain step's.
    model, x = TModel(p=0.0), randn(2, 9, 16)
    ref = copy.deepcopy(model)
    with cs.Chameleon(10**9, model=model, blocks="layers") as eng:
        eng._runner.mode_fn = lambda b: mode
        seen = []
        enter = eng._profiler.module_enter
        monkeypatch.setattr(eng._profiler, "module_enter", lambda m: seen.append(m) or enter(m))
        with eng.step():
            progress = _Progress()
            if limit:       # for the step's forward only (its start and end are not stood in for)
                monkeypatch.setattr(eng, "_memory", progress)
            loss = model(x)
            loss.backward()
            monkeypatch.setattr(eng, "_memory", None)
    names = {n for n, m in model.named_modules() if any(m is s for s in seen)}
    assert {"layers.0", "layers.1", "layers.2", "inp", "head"} <= names
    inside = {n for n, _ in model.named_modules() if n.count(".") >= 2}      # layers.i.<module>
    # With a device_memory_limit every call counts: it reads progress by module count.
    assert bool(names & inside) == (mode == "keep" or limit), sorted(names & inside)
    assert progress.calls == (len(seen) if limit else 0)
    ref_loss = ref(x)
    ref_loss.backward()
    assert_bitwise(ref_loss, grads(ref), loss, grads(model))


def _engine_hooks_registered(eng) -> int:
    """How many of ``eng``'s handles are in torch's global module hook dicts."""
    mod = torch.nn.modules.module
    ids = {h.id for h in eng._hooks}
    return sum(i in ids for i in (*mod._global_forward_pre_hooks, *mod._global_forward_hooks))


def test_paused_takes_idle_engines_hooks_out_and_puts_them_back():
    # What the demo's legs run in: each with no other engine's hooks on its module calls. Out
    # while paused, back after, and the engine's next step learns its module calls as before,
    # with the plain step's bits.
    model, x = TModel(p=0.0), randn(2, 9, 16)
    ref = copy.deepcopy(model)
    eng = cs.Chameleon(10**9, model=model, blocks="layers")
    other = cs.Chameleon(10**9)
    try:
        assert _engine_hooks_registered(eng) == 2 and _engine_hooks_registered(other) == 2
        with module_hooks.paused([eng, other]):
            assert _engine_hooks_registered(eng) == 0 and _engine_hooks_registered(other) == 0
            ref_loss = ref(x)
            ref_loss.backward()
        assert _engine_hooks_registered(eng) == 2 and _engine_hooks_registered(other) == 2
        with eng.step():
            loss = model(x)
            loss.backward()
        assert eng.last_step.block_modes           # the runner's blocks were seen
        assert len(eng._profiler.ids) > 0
        assert_bitwise(ref_loss, grads(ref), loss, grads(model))
    finally:
        eng.close()
        other.close()


def test_paused_refuses_an_engine_in_a_step_and_leaves_a_closed_one_closed():
    model, x = TModel(p=0.0), randn(2, 9, 16)
    eng = cs.Chameleon(10**9)
    with eng.step():
        with pytest.raises(RuntimeError, match="in a step"):
            with module_hooks.paused([eng]):
                pass
        model(x).backward()
    assert _engine_hooks_registered(eng) == 2          # the refusal took nothing out
    with module_hooks.paused([eng]):
        eng.close()
    assert eng._hooks == [] and _engine_hooks_registered(eng) == 0


def test_an_engine_collected_after_a_pause_takes_its_new_hooks_with_it():
    # The finalizer holds the engine's hook list itself: the handles a pause registered anew
    # are the ones removed when an engine never closed is collected.
    mod = torch.nn.modules.module
    before = len(mod._global_forward_pre_hooks) + len(mod._global_forward_hooks)
    eng = cs.Chameleon(10**9)
    with module_hooks.paused([eng]):
        pass
    assert len(mod._global_forward_pre_hooks) + len(mod._global_forward_hooks) == before + 2
    del eng
    gc.collect()
    assert len(mod._global_forward_pre_hooks) + len(mod._global_forward_hooks) == before


@pytest.fixture
def alone():
    """No global module hooks but those the test registers (engines of earlier tests not yet
    collected leave theirs): put back as they were after it."""
    mod = torch.nn.modules.module
    held = [(d, dict(d)) for d in (mod._global_forward_pre_hooks, mod._global_forward_hooks)]
    for d, _ in held:
        d.clear()
    yield
    for d, items in held:
        d.update(items)


class _Counts(torch.nn.Module):
    """Wraps a block's first linear: counts its calls and notes, per call, whether the engine's
    hooks were in torch's global dicts (``engine_hooks_in``)."""

    def __init__(self, inner: torch.nn.Module, eng_ref: list) -> None:
        super().__init__()
        self.inner, self.eng_ref, self.seen = inner, eng_ref, []

    def forward(self, x):
        eng = self.eng_ref[0]
        self.seen.append((torch.is_grad_enabled(), _engine_hooks_registered(eng) if eng else 0))
        return self.inner(x)


def _counted(model):
    """``model`` with its blocks' ``fc1`` wrapped in ``_Counts``; the list the engine goes in."""
    eng_ref = [None]
    for layer in model.layers:
        layer.fc1 = _Counts(layer.fc1, eng_ref)
    return eng_ref


def _steps_match(eng, model, ref, seeds) -> None:
    """A step of ``model`` under ``eng`` and of ``ref`` without it per seed: the same bits, and
    the engine's two hooks in torch's dicts after each."""
    for k in seeds:
        x = randn(2, 9, 16, seed=k)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        with eng.step():
            loss = model(x)
            loss.backward()
        ref_loss = ref(x)
        ref_loss.backward()
        assert_bitwise(ref_loss, grads(ref), loss, grads(model))
        assert _engine_hooks_registered(eng) == 2


@pytest.mark.parametrize("mode", ["full", "keep", "selective"])
def test_the_hooks_step_aside_inside_full_blocks_only_and_come_back(monkeypatch, alone, mode):
    # Inside a full block's forward (no_grad) and its recomputes after the first at a shape, no
    # module event is needed: the engine's hooks leave torch's dicts (module calls take the fast
    # path) and come back after each. The first recompute at a shape keeps them (the probe).
    monkeypatch.setattr(module_hooks, "_compiled", lambda: False)
    model, ref = TModel(p=0.0), TModel(p=0.0)
    eng_ref = _counted(model)
    _counted(ref)
    with cs.Chameleon(10**9, model=model, blocks="layers") as eng:
        eng_ref[0] = eng
        eng._runner.mode_fn = lambda b: mode
        _steps_match(eng, model, ref, range(3))
        seen = [s for layer in model.layers for s in layer.fc1.seen]
    forward = [n for grad, n in seen if not grad]
    recompute = [n for grad, n in seen if grad]
    if mode == "full":
        assert forward == [0] * 9                    # 3 blocks x 3 steps, all out of the way
        # Per block: its first recompute (step 0) with the hooks, the next two without.
        assert sorted(recompute) == [0] * 6 + [2] * 3
    elif mode == "keep":
        assert not forward and recompute == [2] * 9  # kept: called once a step, hooks in
    else:
        assert 2 in recompute and 0 not in recompute    # selective: never out of the way


def test_the_hooks_stay_where_another_hook_or_a_compiled_frame_could_tell(monkeypatch, alone):
    # With a user's own global hook, taking ours out would reorder theirs against ours on the way
    # back: nothing moves, and their hook sees every call inside the block. After torch.compile
    # ran in the process, dynamo may read the dicts when it traces: nothing moves either. The
    # recompute is walked all the same, so gradients stay the plain step's bits.
    model, ref = TModel(p=0.0), TModel(p=0.0)
    eng_ref = _counted(model)
    _counted(ref)
    mod = torch.nn.modules.module
    calls = []
    with cs.Chameleon(10**9, model=model, blocks="layers") as eng:
        eng_ref[0] = eng
        eng._runner.mode_fn = lambda b: "full"
        for compiled, theirs in ((False, True), (True, False)):
            monkeypatch.setattr(module_hooks, "_compiled", lambda: compiled)
            handle = mod.register_module_forward_pre_hook(
                lambda m, a: calls.append(m)) if theirs else None
            try:
                _steps_match(eng, model, ref, range(2))
            finally:
                if handle is not None:
                    handle.remove()
            order = [k for k in (*mod._global_forward_pre_hooks, *mod._global_forward_hooks)]
            assert order == [h.id for h in eng._hooks]
        seen = [n for layer in model.layers for _, n in layer.fc1.seen]
    assert seen and all(n == 2 for n in seen)
    inner = [m for m in calls if any(m is layer.fc1 for layer in model.layers)]
    assert len(inner) == 2 * 3 * 2              # 2 steps x 3 blocks x (forward, recompute)


def test_the_hooks_come_back_when_a_full_block_raises(monkeypatch, alone):
    monkeypatch.setattr(module_hooks, "_compiled", lambda: False)
    model = TModel(p=0.0)
    eng_ref = _counted(model)

    def boom(x):
        raise ValueError("inside the block")
    with cs.Chameleon(10**9, model=model, blocks="layers") as eng:
        eng_ref[0] = eng
        eng._runner.mode_fn = lambda b: "full"
        model.layers[1].fc1.inner.forward = boom
        with pytest.raises(ValueError, match="inside the block"):
            with eng.step():
                model(randn(2, 9, 16))
        assert _engine_hooks_registered(eng) == 2
        assert model.layers[1].fc1.seen == [(False, 0)]       # it ran with them out of the way


def test_the_dicts_stay_the_same_objects_and_a_hook_registered_inside_keeps_running(
        monkeypatch, alone):
    # Stand-ins take the dicts' place, the dicts themselves are never emptied (another thread's
    # module call may be going through them); a hook someone registers inside the block went
    # into a stand-in and runs from then on all the same, and its handle removes it.
    monkeypatch.setattr(module_hooks, "_compiled", lambda: False)
    mod = torch.nn.modules.module
    model = TModel(p=0.0)
    eng_ref = _counted(model)
    seen, handles = [], []
    inner = model.layers[0].fc1.inner
    orig = inner.forward

    def registering(x):
        if not handles:
            handles.append(mod.register_module_forward_pre_hook(lambda m, a: seen.append(m)))
        return orig(x)
    with cs.Chameleon(10**9, model=model, blocks="layers") as eng:
        eng_ref[0] = eng
        eng._runner.mode_fn = lambda b: "full"
        dicts = (mod._global_forward_pre_hooks, mod._global_forward_hooks)
        inner.forward = registering
        with eng.step():
            model(randn(2, 9, 16)).backward()
        assert model.layers[0].fc1.seen[0] == (False, 0)      # registered while out of the way
        assert (mod._global_forward_pre_hooks, mod._global_forward_hooks) == dicts
        assert all(a is b for a, b in zip(dicts, (mod._global_forward_pre_hooks,
                                                  mod._global_forward_hooks)))
        assert _engine_hooks_registered(eng) == 2
        seen.clear()
        model.head(randn(2, 16))
        assert seen == [model.head]
    handles[0].remove()                   # made on a stand-in, it removes the hook all the same
    assert handles[0].id not in dicts[0]
    seen.clear()
    model.head(randn(2, 16))
    assert seen == []
    assert not any(module_hooks._KEPT)            # (pruned at the next quiet block)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-before"])
def test_the_hooks_step_aside_for_a_lean_step_and_come_back(monkeypatch, alone, compiled):
    # A size the budget holds whole runs lean from its first block on (policy/lean.py): its
    # module calls need nothing of the engine but the buffer check, so the hooks leave torch's
    # dicts (the fast call path) until the step ends. Not where torch.compile ran in the
    # process (dynamo may read the dicts when it traces). The step's first visit of the size
    # runs on the executor's path, with the hooks.
    monkeypatch.setattr(module_hooks, "_compiled", lambda: compiled)
    model, ref = TModel(p=0.0), TModel(p=0.0)
    eng_ref = _counted(model)
    _counted(ref)
    with cs.Chameleon(10**9, model=model, blocks="layers", link_bandwidth="10MB/s") as eng:
        eng_ref[0] = eng
        _steps_match(eng, model, ref, range(3))
        assert [s.lean for s in eng.history] == ["", "whole", "whole"]
    seen = [n for layer in model.layers for _, n in layer.fc1.seen]
    # Per block: step 0 with the hooks, steps 1 and 2 out of their way (or in, compiled).
    assert sorted(seen) == ([2] * 9 if compiled else [0] * 6 + [2] * 3)


class _Tail(torch.nn.Module):
    """Three blocks, then ``extra`` calls of a counted linear: a step of the same size (the first
    block's input) that saves more than the steps before it, with module calls after its trip."""

    def __init__(self, eng_ref: list) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(TBlock(16, 0.0) for _ in range(3))
        self.tail = _Counts(torch.nn.Linear(16, 16), eng_ref)
        self.extra = 0

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        for _ in range(self.extra):
            x = torch.sigmoid(self.tail(x))
        return x.square().mean()


def test_a_lean_step_that_trips_has_the_hooks_back_from_its_trip(monkeypatch, alone):
    # From the trip on the step is on the executor's path, which checks buffers at module calls:
    # the hooks come back there, not at the step's end. Bit for bit and within the budget.
    monkeypatch.setattr(module_hooks, "_compiled", lambda: False)
    eng_ref = [None]
    model, ref = _Tail(eng_ref), _Tail([None])
    x = randn(2, 24, 16, seed=3)
    budget = int(natural_peak(model, x) * 1.01)
    with cs.Chameleon(budget, device="cpu", model=model, blocks="layers", min_tensor_bytes=0,
                      link_bandwidth="10MB/s") as eng:
        eng_ref[0] = eng
        for extra in (0, 0, 6):
            model.extra = ref.extra = extra
            train_beside(model, ref, [x], eng, budget)
            assert _engine_hooks_registered(eng) == 2
        assert [s.lean for s in eng.history] == ["", "whole", "tripped"]
    seen = [n for _, n in model.tail.seen]
    first_in = seen.index(2)
    assert 0 < first_in and seen == [0] * first_in + [2] * (6 - first_in)


def test_the_hooks_come_back_when_a_lean_step_raises(monkeypatch, alone):
    monkeypatch.setattr(module_hooks, "_compiled", lambda: False)
    model = TModel(p=0.0)
    eng_ref = _counted(model)
    with cs.Chameleon(10**9, model=model, blocks="layers", link_bandwidth="10MB/s") as eng:
        eng_ref[0] = eng
        for k in range(2):
            with eng.step():
                model(randn(2, 9, 16, seed=k)).backward()
        with pytest.raises(ValueError, match="in a lean step"):
            with eng.step():
                model(randn(2, 9, 16, seed=2))
                assert eng._lean_step and _engine_hooks_registered(eng) == 0
                raise ValueError("in a lean step")
        assert _engine_hooks_registered(eng) == 2 and eng.last_step.failed
        assert eng.records_alive == 0 and eng.resident_bytes == 0


class _Scaled(torch.nn.Module):
    """Blocks whose output is scaled by a buffer: the multiplication saves the buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(TBlock(16, 0.0) for _ in range(3))
        for layer in self.layers:
            layer.register_buffer("gain", torch.full((16,), 1.5))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) * layer.gain
        return x.square().mean()


@pytest.mark.parametrize("blocks", [True, False], ids=["model", "no-model"])
def test_a_lean_step_checks_the_models_buffers_without_the_hooks(monkeypatch, alone, blocks):
    # The buffer check the pre hook made at every module call is made for the model's buffers
    # when the lean path starts (model=): a lean step saves what the executor's path saved, its
    # buffers skipped. Without model= there is no model to look in: a buffer first saved on the
    # lean path counts as an activation (more counted than kept: on the budget's side).
    monkeypatch.setattr(module_hooks, "_compiled", lambda: False)
    model, ref = _Scaled(), _Scaled()
    x = randn(2, 24, 16, seed=3)
    budget = 10**9
    with cs.Chameleon(budget, device="cpu", model=model if blocks else None, min_tensor_bytes=0,
                      link_bandwidth="10MB/s") as eng:
        train_beside(model, ref, [x] * 3, eng, budget)
        first, lean = eng.history[0], eng.history[1:]
    assert [s.lean for s in lean] == ["whole", "whole"]
    gains = 3 * 16 * 4
    for s in lean:
        if blocks:
            assert (s.saved_bytes, s.skipped_bytes) == (first.saved_bytes, first.skipped_bytes)
        else:        # (the first block's was checked at its call, before the lean path began)
            more = s.saved_bytes - first.saved_bytes
            assert 0 < more <= gains and s.skipped_bytes == first.skipped_bytes - more

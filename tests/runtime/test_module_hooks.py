"""The engine's global module hooks (runtime/module_hooks.py): which module calls they tell the
engine about."""
from __future__ import annotations

import copy
import gc

import pytest
import torch

import chameleon_swap as cs
from chameleon_swap.runtime import module_hooks
from _helpers import assert_bitwise, grads
from _models import TModel, randn


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

"""The engine's global module hooks (runtime/module_hooks.py): which module calls they tell the
engine about."""
from __future__ import annotations

import copy

import pytest

import chameleon_swap as cs
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

"""A Ctrl-C escaping a saved tensor's release (interrupts.py): raised again at the step boundary,
the books recounted, and every other unraisable exception left to the hook that was there.

An interrupt cannot be aimed at the first instruction of a ``__del__`` by a signal in a test, so
the releases are replaced by ones that raise there, registered as the engine's own finalizers:
exactly what Python does with an interrupt that lands before the release's ``try``."""
from __future__ import annotations

import copy
import gc
import sys

import pytest
import torch

import chameleon_swap as cs
from chameleon_swap.runtime import interrupts
from chameleon_swap.runtime.records import Handle
from chameleon_swap.runtime.resident import _Saved

from _helpers import assert_bitwise, grads, train_step


@interrupts.finalizer
def _interrupted_at_once(self) -> None:
    raise KeyboardInterrupt          # as if Ctrl-C landed on the release's first instruction


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU())
                                 for _ in range(4)])


def _batch() -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(1))


def _loss(m, x):
    return m(x).square().mean()


@pytest.mark.parametrize("budget,blocks,cls", [(4096, False, Handle), (None, False, _Saved),
                                               (10**9, True, _Saved), (10**9, False, _Saved)],
                         ids=["moving-handles", "resident-saved", "lean-step-saved",
                              "lean-step-saved-no-model"])
def test_interrupt_escaping_a_release_is_raised_again_and_the_books_recounted(budget, blocks,
                                                                               cls, monkeypatch):
    model, ref = _model(), _model()
    x = _batch()
    with cs.Chameleon(budget, device="cpu", min_tensor_bytes=0,
                      **(dict(model=model, blocks=list(model)) if blocks else {})) as eng:
        assert eng._resident_only is (budget is None)       # the lean path's _Saved tuples
        train_step(model, x, eng, _loss)                    # warm: a plan, buffers
        model.zero_grad(set_to_none=True)
        monkeypatch.setattr(cls, "__del__", _interrupted_at_once)
        with pytest.raises(KeyboardInterrupt, match="released a saved tensor"):
            with eng.step():
                _loss(model, x).backward()
        monkeypatch.undo()
        # (a size the budget holds whole: the interrupted step ran lean)
        assert eng.last_step.lean == ("whole" if budget == 10**9 else "")
        gc.collect()
        # Every release was cut off before it began; the next look at the books makes them whole.
        assert eng.records_alive == 0
        assert eng.resident_bytes == 0
        assert eng.host_bytes_in_use == 0
        model.zero_grad(set_to_none=True)
        loss = train_step(model, x, eng, _loss)
    l_ref = train_step(ref, x, None, _loss)
    assert_bitwise(l_ref, grads(ref), loss, grads(model))


def test_other_unraisable_exceptions_reach_the_hook_that_was_there(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_type))
    interrupts.install()                                    # in front of the collector above
    assert sys.unraisablehook is not seen.append
    interrupts.take_pending()

    class Foreign:
        def __init__(self, exc):
            self.exc = exc

        def __del__(self):
            raise self.exc

    Foreign(ValueError("not ours"))
    Foreign(KeyboardInterrupt())                            # a Ctrl-C in someone else's __del__
    assert seen == [ValueError, KeyboardInterrupt]
    assert not interrupts.take_pending()

    class Ours:
        __del__ = _interrupted_at_once

    Ours()
    assert seen == [ValueError, KeyboardInterrupt]          # ours: kept, not printed
    assert interrupts.take_pending()
    assert not interrupts.take_pending()                    # raised once, not at every step


def test_install_is_idempotent_and_chains_once(monkeypatch):
    calls = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: calls.append(1))
    interrupts.install()
    hook = sys.unraisablehook
    interrupts.install()
    cs.Chameleon(None, device="cpu").close()                # an executor made: still one hook
    assert sys.unraisablehook is hook


def test_a_pending_interrupt_is_raised_at_the_next_step_start_once():
    model = _model()
    x = _batch()
    with cs.Chameleon(None, device="cpu", min_tensor_bytes=0) as eng:
        interrupts._escaped()                               # escaped outside any step
        with pytest.raises(KeyboardInterrupt):
            with eng.step():
                pass
        train_step(copy.deepcopy(model), x, eng, _loss)     # once, not again

"""The resident-only hooks (``resident.py``) of an engine that can never move anything: the same
figures as the full path (``saved_bytes``, ``peak_resident_bytes``, ``skipped_bytes``), buffers
and parameters skipped, in-place modification caught, bitwise gradients, one module hook."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import chameleon_swap as cs

from _helpers import assert_bitwise, grads, train_step
from _models import TINY_LM, randn, tiny_llama, tiny_moe
from _models import tokens as _tokens

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")   # see conftest.py

TINY = TINY_LM
INPLACE_ERROR = "modified by an inplace operation"


def tokens(B, T, seed=0):
    return _tokens(TINY["vocab_size"], B, T, seed)


llama, moe = tiny_llama, tiny_moe


def global_hooks() -> tuple[int, int]:
    m = torch.nn.modules.module
    return len(m._global_forward_pre_hooks), len(m._global_forward_hooks)


def test_only_an_engine_that_can_move_registers_both_module_hooks(tmp_path):
    before = global_hooks()
    with cs.Chameleon(None, device="cpu") as eng:
        assert eng._resident_only
        assert global_hooks() == (before[0] + 1, before[1])        # the buffer hook alone
    assert global_hooks() == before
    # One pre-hook and one forward hook, model= included: the recompute runner's probe runs in
    # the engine's pre-hook, not in a third global hook on every module call.
    for kw in (dict(budget=10**9), dict(budget=None, trace_dir=tmp_path),
               dict(budget=None, model=llama())):
        with cs.Chameleon(device="cpu", **kw) as eng:
            assert not eng._resident_only
            assert global_hooks() == (before[0] + 1, before[1] + 1)
    assert global_hooks() == before


@pytest.mark.parametrize("make", [llama, moe], ids=["llama", "moe"])
def test_same_figures_as_the_full_path(make):
    """A budget never reached runs the executor's full path: the resident-only hooks must report
    the same saved, peak and skipped bytes (Llama saves RoPE buffers and transposed weights),
    and both give the plain code's gradients bit for bit."""
    model = make()
    batches = [tokens(2, T, seed=i) for i, T in enumerate([12, 20, 12])]
    runs = {}
    for budget in (None, 10**12):
        m = copy.deepcopy(model)
        with cs.Chameleon(budget, device="cpu", min_tensor_bytes=0) as eng:
            for b in batches:
                m.zero_grad(set_to_none=True)
                train_step(m, b, eng)
            runs[budget] = ([(s.saved_bytes, s.peak_resident_bytes, s.skipped_bytes)
                             for s in eng.history], grads(m), eng.resident_bytes)
    figures, _, resident = runs[None]
    assert figures == runs[10**12][0] and resident == 0
    assert all(saved > 0 and peak > 0 and skipped > 0 for saved, peak, skipped in figures)
    ref = copy.deepcopy(model)
    for b in batches:
        ref.zero_grad(set_to_none=True)
        loss = train_step(ref, b)
    assert_bitwise(loss, grads(ref), loss, runs[None][1])


class BufferAndViews(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(randn(8, 8, seed=1))
        self.register_buffer("scale", randn(4, 8, seed=2))

    def forward(self, x):
        a = x @ self.w.t()                    # saves x (w needs its gradient)
        b = a.sin()                           # saves a
        c = b * self.scale                    # saves the buffer
        d = c * self.scale[0]                 # saves a view of the buffer
        return (d.t() @ d).sum()              # saves d twice: its transpose and itself


def test_buffers_are_skipped_and_views_share_a_record():
    model = BufferAndViews()
    ref = copy.deepcopy(model)
    x = randn(4, 8, seed=3)
    with cs.Chameleon(None, device="cpu", min_tensor_bytes=0) as eng:
        loss = train_step(model, x, eng)
        s = eng.last_step
    act = 4 * 8 * 4
    assert s.saved_bytes == 3 * act                       # x, a, d (once for two views)
    assert s.peak_resident_bytes == 3 * act
    assert s.skipped_bytes == 2 * act                     # scale, scale[0] (its storage)
    assert_bitwise(train_step(ref, x), grads(ref), loss, grads(model))


@pytest.mark.parametrize("what", ["activation", "parameter", "buffer"])
def test_inplace_after_save_raises(what):
    model = BufferAndViews()
    x = randn(4, 8, seed=3).requires_grad_()          # so that mm saves w.t() too
    with cs.Chameleon(None, device="cpu", min_tensor_bytes=0) as eng:
        with pytest.raises(RuntimeError, match=INPLACE_ERROR):
            with eng.step():
                a = x @ model.w.t()
                b = a.sin()                   # saves a
                y = (b * model.scale).sum()
                with torch.no_grad():
                    {"activation": a, "parameter": model.w, "buffer": model.scale}[what].add_(1)
                y.backward()
        assert eng.last_step.failed and eng.resident_bytes == 0


def test_a_graph_kept_past_a_failed_step_cannot_be_used():
    x = randn(4, 8, seed=3).requires_grad_()
    with cs.Chameleon(None, device="cpu", min_tensor_bytes=0) as eng:
        kept = []
        with pytest.raises(ValueError):
            with eng.step():
                kept.append((x * 2).sin().sum())
                raise ValueError("user error")
        assert eng.resident_bytes == 0 and not eng._ex.live
        with pytest.raises(RuntimeError, match="released because its step ended with an exception"):
            kept[0].backward()


def test_saved_tensor_freed_in_forward_is_uncounted_and_resaved_counts_again():
    x = randn(64, 64, seed=3).requires_grad_()
    with cs.Chameleon(None, device="cpu", min_tensor_bytes=0) as eng:
        with eng.step():
            a = x * 2
            (a.sin() * 1).sum()               # a graph dropped at once: a's record released
            assert eng.resident_bytes == 0
            y = a.cos().sum()                 # a saved again: a new record
            assert eng.resident_bytes == a.untyped_storage().nbytes()
            y.backward()
        s = eng.last_step
    assert s.saved_bytes == 2 * 64 * 64 * 4 and s.peak_resident_bytes == 64 * 64 * 4


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_module_inside_a_resident_only_step_is_bitwise(backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh())
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    try:
        with cs.Chameleon(None, device="cpu", min_tensor_bytes=0) as eng:
            for i in range(2):
                x = randn(8, 16, seed=i)
                model.zero_grad(set_to_none=True)
                ref.zero_grad(set_to_none=True)
                l_ref = ref(x).pow(2).sum()
                l_ref.backward()
                with eng.step():
                    loss = compiled(x).pow(2).sum()
                    loss.backward()
                assert_bitwise(l_ref.detach(), grads(ref), loss.detach(), grads(model))
                assert eng.last_step.saved_bytes > 0 and not eng.last_step.failed
    finally:
        torch._dynamo.reset()


def test_a_lean_release_on_another_thread_while_the_lock_is_held_is_recounted_at_settle():
    """On an engine with a budget a lean record's release never waits for the executor's lock
    off the main thread (a copy worker's caller may hold it while a garbage collection runs on
    that worker): it leaves the record's count one too high and asks ``settle`` to recount the
    lean records' holders. Before, such a record stayed alive and counted for good."""
    import gc
    import threading

    from _models import lm_batches
    model = tiny_llama(n_layers=3)
    batch = lm_batches(model, [16])[0]
    with cs.Chameleon(10**9, device="cpu", model=model, min_tensor_bytes=0) as eng:
        train_step(model, batch, eng)
        with eng.step():
            box = [model(*batch)]
            ex = eng._ex
            assert ex.lean and any(not r.handles for r in ex.live)
            with ex.lock:                    # held here while another thread frees the graph
                t = threading.Thread(target=box.clear)
                t.start()
                t.join(timeout=30)
                assert not t.is_alive()      # it did not wait for the lock
            assert ex.recount and any(not r.handles for r in ex.live)
        assert eng.last_step.lean == "whole"
        # Settled, no lean record is left (what the step saved before its lean path began has
        # handles, released as they die: here the model's graph keeps a part of them a while)
        held = eng.resident_bytes
        assert not [r for r in ex.live if not r.handles]
        assert held == sum(r.nbytes for r in ex.live if r.counted)
        train_step(model, batch, eng)        # and the next step is as before
        gc.collect()
        assert eng.last_step.lean == "whole"
        assert eng.resident_bytes == 0 and eng.records_alive == 0

"""Autograd semantics are kept exactly with the engine on.

Every test runs the same code twice, without the engine and inside ``eng.step()`` at a budget that
forces offloading (0 bytes, or a fifth of the code's own natural peak, with min_tensor_bytes=0),
and compares the loss and every gradient with ``torch.equal``. Covered: the in-place check on saved
tensors in every residency state (LESSONS 11), retain_graph, double backward, non-reentrant
checkpoint, autocast, gradient accumulation, no_grad regions, torch.compile (LESSONS 14),
``torch.autograd.grad`` and ``backward(inputs=...)``.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import chameleon_swap as cs
from chameleon_swap.runtime.executor import HOST, OFFLOADING, RESIDENT
from chameleon_swap.workloads import Llama, LlamaConfig

from _helpers import grads
from _models import FunctionalModel, ViewsModel, randn

TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
FRACTIONS = [0.2, 0.0]
INPLACE_ERROR = "modified by an inplace operation"


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")   # see conftest.py


def engine(budget, **kw):
    kw.setdefault("min_tensor_bytes", 0)
    return cs.Chameleon(budget, device="cpu", **kw)


def llama():
    torch.manual_seed(0)
    return Llama(LlamaConfig(**TINY))


def tokens(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(TINY["vocab_size"], (B, T + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def dense(B=2, T=9, dim=16, seed=1):
    return randn(B, T, dim, seed=seed)


def no_step():
    return contextlib.nullcontext()


def with_grads(model, **tensors) -> dict:
    """The tensors to compare: the given ones (detached) and every parameter's .grad."""
    out = {k: v.detach().clone() for k, v in tensors.items()}
    out.update({f"grad:{n}": g for n, g in grads(model).items()})
    return out


def assert_same(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys()
    for k in expected:
        a, b = expected[k], got[k]
        assert (a is None) == (b is None), f"{k}: presence differs"
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, (k, a.dtype, b.dtype, a.shape, b.shape)
            assert torch.equal(a, b), f"{k} differs (max abs diff {(a.float() - b.float()).abs().max()})"


def check(make_model, fn, fraction):
    """Run ``fn(model, step)`` without the engine (``step`` a no-op context) and with it (``step`` is
    ``eng.step``) on copies of one model; ``fn`` returns a dict of tensors (see ``with_grads``).
    The budget is ``fraction`` of the smallest per-step peak the same code has with no budget
    (None: no budget). Asserts bitwise equality, the budget on every step, that the budget forced
    moves both ways, and that nothing is held once ``fn`` returned. Returns the engine's history."""
    model = make_model()
    ref, probe, test = (copy.deepcopy(model) for _ in range(3))
    expected = fn(ref, no_step)
    with engine(None) as eng:
        fn(probe, eng.step)
        peak = min(s.peak_resident_bytes for s in eng.history)
    assert peak > 0
    budget = None if fraction is None else int(peak * fraction)
    with engine(budget) as eng:
        got = fn(test, eng.step)
        history = list(eng.history)
        assert eng.host_bytes_in_use == 0 and eng.resident_bytes == 0, "saved tensors still held"
    assert_same(expected, got)
    for s in history:
        assert not s.failed
        assert s.budget_bytes == budget, s
        if budget is not None:
            assert s.peak_resident_bytes <= budget, s
        else:
            assert s.offloaded_bytes == 0 and s.peak_resident_bytes == s.saved_bytes > 0, s
    if budget is not None:
        assert sum(s.offloaded_bytes for s in history) > 0, "the budget forced no move"
        assert sum(s.prefetched_bytes + s.fetched_bytes for s in history) > 0
    return history


# --------------------------------------------------------------------------- in-place checks
N = 32                         # a (N, N) float32 intermediate: 4 KiB
NBYTES = N * N * 4
STATES = {
    # state of the saved tensor when it is modified: (budget, copy delay in seconds)
    RESIDENT: (None, 0.0),
    OFFLOADING: (int(1.5 * NBYTES), 0.25),   # the guard starts its copy-out after the save
    HOST: (0, 0.0),                          # copied out synchronously inside the pack hook
}


def make_engine(state, monkeypatch):
    budget, delay = STATES[state]
    monkeypatch.setenv("CHAMELEON_SWAP_TEST_COPY_DELAY", str(delay))
    eng = engine(budget)
    assert eng._copy.delay_s == delay           # the slow copy engine really is in use
    return eng


def state_of(eng, t: torch.Tensor) -> str:
    return eng._ex.record_of(t.untyped_storage()).state


def modify_after_save(eng, state, *, saved="tensor", keep_ref=True):
    """A fresh intermediate ``a`` is saved by sin (as ``a`` itself or as a temporary view of it),
    then modified in place while the saved copy is in ``state``; then backward."""
    x = randn(N, N, seed=3).requires_grad_()
    with eng.step() if eng is not None else no_step():
        a = x * 2                                # mul by a Python scalar saves nothing
        y = (a if saved == "tensor" else a.t()).sin()
        if eng is not None:
            assert state_of(eng, a) == state
        a.add_(1)
        if not keep_ref:
            del a                                # the caller lets go of the modified tensor
        y.sum().backward()


@pytest.mark.parametrize("state", list(STATES))
def test_inplace_after_save_raises(state, monkeypatch):
    """LESSONS 11: with saved-tensor hooks autograd cannot check versions; the engine must raise
    autograd's error itself, whether the saved tensor is resident, being copied out, or on host."""
    with pytest.raises(RuntimeError, match=INPLACE_ERROR):
        modify_after_save(None, state)
    with make_engine(state, monkeypatch) as eng:
        with pytest.raises(RuntimeError, match=INPLACE_ERROR):
            modify_after_save(eng, state)
        assert eng.last_step.failed
        if state != RESIDENT:
            assert eng.last_step.offloaded_bytes > 0
        assert eng.host_bytes_in_use == 0 and eng.resident_bytes == 0


@pytest.mark.parametrize("variant", ["dropped-ref", "temporary-view"])
@pytest.mark.parametrize("state", list(STATES))
def test_inplace_after_save_raises_when_saved_object_is_gone(state, variant, monkeypatch):
    """LESSONS 11, the common shapes: a local modified in place and then out of scope, or an
    alias modified while the saved tensor was a temporary view (matmul saves ``w.t()``). Autograd
    raises in both: its saved variable shares the version counter with every alias."""
    kw = dict(keep_ref=False) if variant == "dropped-ref" else dict(saved="view")
    with pytest.raises(RuntimeError, match=INPLACE_ERROR):
        modify_after_save(None, state, **kw)
    with make_engine(state, monkeypatch) as eng:
        with pytest.raises(RuntimeError, match=INPLACE_ERROR):
            modify_after_save(eng, state, **kw)


class OneWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(randn(24, 16, seed=7) / 4)


@pytest.mark.parametrize("fraction", FRACTIONS + [None])
def test_inplace_before_save_is_fine(fraction):
    """In-place ops on fresh intermediates before anything saves them (and relu_, which saves its
    own modified output) are legal: bitwise equal to the run without the engine (LESSONS 11: the
    version recorded is the one at save time, not at creation)."""
    def fn(m, step):
        x = dense(seed=2)
        with step():
            h = x @ m.w.t()                      # fresh; matmul saves x and w.t(), not h
            h.mul_(0.5).add_(0.1)
            h = torch.relu_(h)                   # saves its output, at its new version
            g = h + 1                            # fresh; add saves nothing
            g.mul_(3)                            # in place before anything saves g
            loss = (torch.tanh(h) * g.sigmoid()).sum()
            loss.backward()
        return with_grads(m, loss=loss)

    check(OneWeight, fn, fraction)


# --------------------------------------------------------------------------- retain_graph
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_retain_graph_then_second_backward(fraction):
    """The first backward must not consume what the second needs: host copies stay valid until the
    graph is freed, and gradients accumulate exactly as without the engine."""
    batch = tokens(2, 12, seed=0)

    def fn(m, step):
        with step():
            loss = m(*batch)
            loss.backward(retain_graph=True)
            first = with_grads(m)
            (loss * 0.5).backward()
        return {**with_grads(m, loss=loss), **{f"first {k}": v for k, v in first.items()}}

    s = check(llama, fn, fraction)[-1]
    # Both backward passes read the offloaded tensors back.
    assert s.prefetched_bytes + s.fetched_bytes > s.offloaded_bytes


# --------------------------------------------------------------------------- double backward
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("make", [ViewsModel, FunctionalModel], ids=["views", "functional"])
def test_double_backward_gradient_penalty(make, fraction):
    """create_graph=True: the first backward saves tensors of its own (through the same hooks) and
    the second backward differentiates through them."""
    def fn(m, step):
        with step():
            x = dense(seed=4).requires_grad_()
            loss = m(x)
            gx, = torch.autograd.grad(loss, x, create_graph=True)
            penalty = gx.pow(2).sum()
            total = loss + 10.0 * penalty
            total.backward()
        return with_grads(m, loss=loss, penalty=penalty, x_grad=x.grad)

    check(make, fn, fraction)
    # Not a tautology: the second-order term changes the weights' gradients.
    m = make()
    m(dense(seed=4)).backward()
    with_penalty = fn(make(), no_step)
    assert any(not torch.equal(g, with_penalty[f"grad:{n}"]) for n, g in grads(m).items())


# --------------------------------------------------------------------------- checkpoint
class Checkpointed(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return checkpoint(self.block, *args, use_reentrant=False)


def llama_first_layer_checkpointed():
    m = llama()
    m.layers[0] = Checkpointed(m.layers[0])     # layer 1 saves through the engine as usual
    return m


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_non_reentrant_checkpoint_inside_step(fraction):
    """torch.utils.checkpoint(use_reentrant=False) installs saved-tensor hooks of its own inside
    ours; its recomputation runs during backward, inside the engine's step."""
    batch = tokens(2, 16, seed=1)

    def fn(m, step):
        with step():
            loss = m(*batch)
            loss.backward()
        return with_grads(m, loss=loss)

    history = check(llama_first_layer_checkpointed, fn, fraction)
    # Checkpointing really kept layer 0's activations away from the engine.
    with engine(None) as eng:
        fn(llama(), eng.step)
        plain = eng.last_step.saved_bytes
    assert history[-1].saved_bytes < plain


# --------------------------------------------------------------------------- autocast
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_autocast_bf16(fraction):
    """bf16 activations (and autocast's cached bf16 weight casts, which are not leaves) are saved,
    moved and rebuilt with their dtype."""
    batch = tokens(2, 12, seed=2)

    def fn(m, step):
        with step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = m(batch[0])
                loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[1].flatten())
            loss.backward()
        return with_grads(m, loss=loss, logits=logits)

    check(llama, fn, fraction)
    assert fn(llama(), no_step)["logits"].dtype == torch.bfloat16


# --------------------------------------------------------------------------- accumulation
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_gradient_accumulation_over_steps(fraction):
    """Several steps (micro-batches of different lengths) accumulate into .grad before anyone
    reads it."""
    micro = [tokens(2, T, seed=10 + i) for i, T in enumerate([12, 20, 7])]

    def fn(m, step):
        losses = []
        for b in micro:
            with step():
                loss = m(*b) / len(micro)
                loss.backward()
            losses.append(loss.detach())
        return with_grads(m, losses=torch.stack(losses))

    history = check(llama, fn, fraction)
    assert [s.step for s in history] == [0, 1, 2]


# --------------------------------------------------------------------------- no_grad
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_no_grad_region_inside_step(fraction):
    """A no_grad forward inside the step (targets from the model itself) saves nothing and changes
    nothing."""
    inp, _ = tokens(2, 16, seed=3)

    def fn(m, step):
        with step():
            with torch.no_grad():
                targets = m(inp).argmax(-1)
            assert targets.grad_fn is None
            loss = m(inp, targets)
            loss.backward()
        return with_grads(m, loss=loss, targets=targets)

    history = check(llama, fn, fraction)
    # Only the grad-enabled forward saved: same bytes as a step without the no_grad region.
    targets = fn(llama(), no_step)["targets"]

    def grad_only(m, step):
        with step():
            loss = m(inp, targets)
            loss.backward()
        return with_grads(m, loss=loss)

    with engine(None) as eng:
        grad_only(llama(), eng.step)
        assert history[-1].saved_bytes == eng.last_step.saved_bytes


# --------------------------------------------------------------------------- autograd.grad, inputs=
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_autograd_grad_instead_of_backward(fraction):
    batch = tokens(2, 14, seed=4)

    def fn(m, step):
        names, params = zip(*m.named_parameters())
        with step():
            loss = m(*batch)
            gs = torch.autograd.grad(loss, params)
        assert all(p.grad is None for p in params)    # autograd.grad does not accumulate
        return {"loss": loss.detach(), **{f"grad:{n}": g for n, g in zip(names, gs)}}

    check(llama, fn, fraction)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_backward_with_inputs(fraction):
    """backward(inputs=...) runs only part of the graph: the nodes it skips keep their saved tensors
    until the graph is dropped, and then release them (check() asserts nothing is held)."""
    batch = tokens(2, 14, seed=5)

    def fn(m, step):
        chosen = [p for n, p in m.named_parameters() if n.startswith(("layers.1.", "output."))]
        with step():
            loss = m(*batch)
            loss.backward(inputs=chosen)
        out = with_grads(m, loss=loss)
        assert sum(g is not None for g in out.values()) == len(chosen) + 1
        return out

    check(llama, fn, fraction)


# --------------------------------------------------------------------------- torch.compile
def _compiled_steps(backend, n_steps):
    def fn(m, step):
        compiled = torch.compile(m, backend=backend)
        out = {}
        for i in range(n_steps):
            m.zero_grad(set_to_none=True)
            with step():
                loss = compiled(dense(seed=20 + i))
                loss.backward()
            out.update({f"step {i} {k}": v for k, v in with_grads(m, loss=loss).items()})
        return out
    return fn


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_region_inside_step(backend):
    """LESSONS 14: a compiled module inside a step is either correct or refused, never silently
    wrong. On this torch the engine's hooks are plain Python, so AOTAutograd does not inline them
    and applies them at run time to what the compiled graph saves: the compiled region is managed
    (it counts against the budget and moves), and results equal the same compiled code without
    the engine. (Inductor is left out for time: by hand, on ViewsModel, it also matched the same
    compiled code without the engine bit for bit; both differ from eager, as inductor does.)"""
    torch._dynamo.reset()
    history = check(ViewsModel, _compiled_steps(backend, 2), 0.2)
    # Every step was managed, the one that compiled and the next.
    assert all(s.offloaded_bytes > 0 for s in history), history


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_torch_compile_past_the_recompile_limit():
    """Each step recompiles (see below); once dynamo's recompile limit is hit it runs the module
    uncompiled: still correct."""
    torch._dynamo.reset()
    # config.patch, not monkeypatch: recompile_limit lives behind the config module's
    # __getattr__, and monkeypatch's undo deletes such an attribute (breaking dynamo for every
    # later test).
    with torch._dynamo.config.patch(recompile_limit=1):
        check(ViewsModel, _compiled_steps("eager", 3), 0.2)


class TinyMLP(nn.Module):
    """One submodule: the module hooks the engine installs run inside the compiled region."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(16, 32)
        self.w2 = nn.Parameter(randn(1, 32, seed=9) / 6)

    def forward(self, x):
        return (torch.tanh(self.inner(x)) @ self.w2.t()).pow(2).mean()


def compiled_frames(eng, n_steps=2) -> int:
    """Graphs dynamo compiles for a small module over ``n_steps`` steps."""
    import gc

    from torch._dynamo.testing import CompileCounterWithBackend
    gc.collect()         # engines of earlier tests that were never closed: their hooks go too
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(TinyMLP(), backend=counter)
    for i in range(n_steps):
        with eng.step() if eng is not None else no_step():
            compiled(dense(seed=30 + i)).backward()
    return counter.frame_count


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_torch_compile_does_not_recompile_every_step():
    """A compiled module inside eng.step() compiles once, not once per step (support for compiled
    regions, LESSONS 14, includes keeping them compiled: re-registering the engine's hooks every
    step made dynamo recompile each step until its recompile limit, then run uncompiled).
    While an engine is alive its module hooks run eagerly (torch.compiler.disable), which splits a
    compiled module at its submodule boundaries; the count of graphs is therefore compared between
    2 and 5 steps, not with a run without any engine."""
    with engine(0) as eng:
        two = compiled_frames(eng, n_steps=2)
        five = compiled_frames(eng, n_steps=5)
    assert two == five, (two, five)

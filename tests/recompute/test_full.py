"""Full recomputation (recompute/full.py): a forward that records nothing, a backward that runs the
block again, and every gradient what the plain step gives, however the backward is asked for."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from _helpers import assert_bitwise, grads
from _models import randn
from chameleon_swap.recompute.runner import BlockRunner

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class Books:
    """The runner's accountant: holds, and a record index nobody advances."""
    next_index = 0

    def hold(self, nbytes: int) -> int:
        return 0

    def release_hold(self, token: int) -> None:
        pass


class Block(nn.Module):
    def __init__(self, d: int = 8, shared: nn.Module | None = None) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 3 * d), nn.Linear(3 * d, d)
        object.__setattr__(self, "shared", shared)      # called, not held: not its parameter

    def forward(self, x, scale=None):
        h = self.fc2(torch.tanh(self.fc1(x)))
        if self.shared is not None:
            h = self.shared(h)
        return x + (h if scale is None else h * scale)


class Net(nn.Module):
    def __init__(self, n: int = 3, shared: bool = False) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.shared = nn.Linear(8, 8) if shared else None
        self.layers = nn.ModuleList(Block(shared=self.shared) for _ in range(n))

    def forward(self, x, scale=None):
        for layer in self.layers:
            x = layer(x, scale=scale)
        return x.pow(2).mean()


def runner_for(model) -> BlockRunner:
    r = BlockRunner(model, "layers", mode_fn=lambda b: "full", accountant=Books())
    r.install()
    return r


def stepped(runner, fn):
    runner.begin_step(False)
    try:
        return fn()
    finally:
        runner.end_step(False)


def shared_first(first: type, seed: int) -> nn.Module:
    """Layers ``first`` and ``Block``, the first calling a module the model holds (``shared``)."""
    torch.manual_seed(seed)
    shared = nn.Linear(8, 8)
    model = nn.Module()
    model.shared = shared
    model.layers = nn.ModuleList([first(shared=shared), Block()])
    return model


def trained(m, x):
    """One forward and backward of ``m``'s layers on ``x`` (models without a forward of their
    own); the loss."""
    h = x
    for layer in m.layers:
        h = layer(h)
    loss = h.pow(2).mean()
    loss.backward()
    return loss.detach()


def test_the_forward_saves_only_the_calls_tensors():
    model = Net()
    runner = runner_for(model)
    x = randn(2, 5, 8).requires_grad_()
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        loss = stepped(runner, lambda: model.layers[0](x))
    assert len(packed) == 1 and packed[0] is x          # the block's input, nothing inside
    loss.sum().backward()


def test_autograd_grad_gives_the_plain_steps_gradients_and_fills_no_grad():
    model, ref = Net(), Net()
    runner = runner_for(model)
    x = randn(2, 5, 8)
    params, ref_params = list(model.parameters()), list(ref.parameters())
    got = stepped(runner, lambda: torch.autograd.grad(model(x), params))
    want = torch.autograd.grad(ref(x), ref_params)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(p.grad is None for p in params)


def test_backward_with_inputs_fills_only_those():
    model, ref = Net(), Net()
    runner = runner_for(model)
    x = randn(2, 5, 8)
    chosen = [model.layers[1].fc1.weight, model.layers[2].fc2.bias]
    stepped(runner, lambda: model(x).backward(inputs=chosen))
    ref(x).backward(inputs=[ref.layers[1].fc1.weight, ref.layers[2].fc2.bias])
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name


def test_parameters_get_gradients_when_no_input_requires_grad():
    # (torch's reentrant checkpoint leaves them None: its Function is not in the graph then.)
    model, ref = Net(), Net()
    runner = runner_for(model)
    x = randn(2, 5, 8)
    assert not x.requires_grad
    loss = stepped(runner, lambda: (lambda l: (l.backward(), l)[1])(model(x)))
    ref_loss = ref(x)
    ref_loss.backward()
    assert_bitwise(ref_loss, grads(ref), loss, grads(model))


def test_a_gradient_penalty_differentiates_through_the_recompute():
    # Right on the first step, though not to the bit: three or more contributions to one weight
    # meet in another order (full.py; here 1.5e-8 on a weight of norm about 1). From then on full
    # blocks run torch's non-reentrant checkpoint, and every step is the plain step's bits.
    model, ref = Net(), Net()
    runner = runner_for(model)

    def penalty(m, xx):
        xx = xx.clone().requires_grad_()
        loss = m(xx)
        gx, = torch.autograd.grad(loss, xx, create_graph=True)
        total = loss + gx.pow(2).sum()
        total.backward()
        return total.detach()

    for T in (5, 6, 7):
        x = randn(2, T, 8, seed=T)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        got = stepped(runner, lambda: penalty(model, x))
        want = penalty(ref, x)
        if T == 5:
            assert runner._create_graph
            assert torch.allclose(got, want, rtol=1e-6, atol=0)
            for (name, a), b in zip(grads(ref).items(), grads(model).values()):
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), name
        else:
            assert_bitwise(want, grads(ref), got, grads(model))


def test_a_tensor_keyword_that_requires_grad_gets_its_gradient():
    model, ref = Net(), Net()
    runner = runner_for(model)
    x = randn(2, 5, 8)
    s, s_ref = torch.full((8,), 0.5, requires_grad=True), torch.full((8,), 0.5, requires_grad=True)
    stepped(runner, lambda: model(x, scale=s).backward())
    ref(x, scale=s_ref).backward()
    assert torch.equal(s.grad, s_ref.grad)
    assert_bitwise(torch.zeros(()), grads(ref), torch.zeros(()), grads(model))


def test_a_module_the_block_calls_but_does_not_hold_gets_every_gradient():
    # The shared Linear is no block's parameter: the first backward finds it in the recompute's
    # graph (its gradients accumulated directly); later calls pass it to the Function.
    model, ref = Net(shared=True), Net(shared=True)
    runner = runner_for(model)
    for T in (5, 7, 6):
        x = randn(2, T, 8, seed=T)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss = stepped(runner, lambda: (lambda l: (l.backward(), l)[1])(model(x)))
        ref_loss = ref(x)
        ref_loss.backward()
        assert_bitwise(ref_loss, grads(ref), loss, grads(model))
    assert all(any(t is model.shared.weight for t in runner._foreign[i]) for i in range(3))
    # From the second call on, through the Function: autograd.grad sees them too.
    x = randn(2, 5, 8)
    got = stepped(runner, lambda: torch.autograd.grad(model(x), [model.shared.weight]))
    want = torch.autograd.grad(ref(x), [ref.shared.weight])
    assert torch.equal(got[0], want[0])


class Reentrant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Block()

    def forward(self, x, scale=None):
        return checkpoint(self.inner, x, use_reentrant=True)


def test_the_users_reentrant_checkpoint_inside_accumulates_as_it_does():
    torch.manual_seed(4)
    model = nn.Module()
    model.layers = nn.ModuleList([Block(), Reentrant(), Block()])
    ref = copy.deepcopy(model)
    runner = runner_for(model)
    for T in (5, 6):
        x = randn(2, T, 8, seed=T)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss = stepped(runner, lambda: trained(model, x))
        assert_bitwise(trained(ref, x), grads(ref), loss, grads(model))
        assert runner._reentrant == {1}


class Sometimes(Block):
    """Calls the shared module only on inputs longer than 6."""

    def forward(self, x, scale=None):
        h = self.fc2(torch.tanh(self.fc1(x)))
        return x + (self.shared(h) if x.shape[1] > 6 else h)


def test_a_leaf_reached_first_at_a_new_shape_is_found_there():
    # A block's backward is walked once per shape of its inputs (and always once it reached a
    # leaf not its own): a shared module first called at a new length is found at that length.
    model = shared_first(Sometimes, seed=2)
    ref = copy.deepcopy(model)
    runner = runner_for(model)
    found = []
    for T in (5, 5, 7, 7, 5):
        x = randn(2, T, 8, seed=T)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss = stepped(runner, lambda: trained(model, x))
        assert_bitwise(trained(ref, x), grads(ref), loss, grads(model))
        found.append(0 in runner._foreign)
    assert found == [False, False, True, True, True]
    assert [t is model.shared.weight for t in runner._foreign[0]][:1] == [True]
    assert 1 not in runner._foreign
    assert sum(k[0] == 1 for k in runner._walked) == 2      # block 1: lengths 5 and 7, once each


class OnValues(Block):
    """Calls the shared module only where the input's sum is positive: chosen by values."""

    def forward(self, x, scale=None):
        h = self.fc2(torch.tanh(self.fc1(x)))
        return x + (self.shared(h) if float(x.sum()) > 0 else h)


@pytest.mark.parametrize("engine", [False, True])
def test_a_module_called_first_on_a_shape_already_walked_is_found_by_the_probe(engine):
    # No walk at the second step (its shape was walked at the first): the shared module it calls
    # there for the first time is seen calling, and its gradients are all there.
    import chameleon_swap as cs
    model = shared_first(OnValues, seed=6)
    ref = copy.deepcopy(model)
    xs = [-randn(2, 5, 8, seed=1).abs(), randn(2, 5, 8, seed=2).abs(), randn(2, 5, 8, seed=3)]
    if engine:
        eng = cs.Chameleon(None, model=model, blocks="layers")
        runner, step = eng._runner, eng.step
        runner.mode_fn = lambda b: "full"
    else:
        runner = runner_for(model)
        step = None
    for k, x in enumerate(xs):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        if step is not None:
            with step():
                loss = trained(model, x)
        else:
            loss = stepped(runner, lambda: trained(model, x))
        assert_bitwise(trained(ref, x), grads(ref), loss, grads(model))
        assert (0 in runner._foreign) == (k > 0)
    assert sum(k[0] == 0 for k in runner._walked) == 1


class OnValuesLeaf(Block):
    """Scales by a tensor it holds as a plain attribute (no module's parameter, so no probe can
    see it) only where the input's sum is positive: a leaf reached by values."""

    def __init__(self, shared=None) -> None:
        super().__init__()
        self.gain = torch.full((8,), 1.5, requires_grad=True)

    def forward(self, x, scale=None):
        h = self.fc2(torch.tanh(self.fc1(x)))
        return x + (h * self.gain if float(x.sum()) > 0 else h)


def test_with_the_engine_a_leaf_first_reached_on_a_walked_shape_gets_its_gradient():
    # The engine's full recomputes after the first at a shape run with its module hooks out of
    # the way and are walked every time instead: a leaf no module holds, first reached by
    # values at a shape already walked, gets its gradient in that very backward (a runner on
    # its own, with no engine, walks once per shape: ``full.py``'s limit).
    import chameleon_swap as cs
    model = shared_first(OnValuesLeaf, seed=7)
    ref = copy.deepcopy(model)
    xs = [-randn(2, 5, 8, seed=1).abs(), randn(2, 5, 8, seed=2).abs(), randn(2, 5, 8, seed=3)]
    with cs.Chameleon(None, model=model, blocks="layers") as eng:
        eng._runner.mode_fn = lambda b: "full"
        for k, x in enumerate(xs):
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            model.layers[0].gain.grad = ref.layers[0].gain.grad = None
            with eng.step():
                loss = trained(model, x)
            assert_bitwise(trained(ref, x), grads(ref), loss, grads(model))
            got, want = model.layers[0].gain.grad, ref.layers[0].gain.grad
            assert (got is None) == (want is None) == (k == 0)
            assert want is None or torch.equal(got, want)
        assert sum(k[0] == 0 for k in eng._runner._walked) == 1


class Passes(nn.Module):
    """A block that returns its input, or a view of it (a skipped layer)."""

    def __init__(self, view: bool) -> None:
        super().__init__()
        self.unused, self.view = nn.Linear(8, 8), view

    def forward(self, x, scale=None):
        return x.view(x.shape) if self.view else x


@pytest.mark.parametrize("view", [False, True])
def test_a_block_that_returns_its_input_or_a_view_of_it(view):
    torch.manual_seed(8)
    model = nn.Module()
    model.layers = nn.ModuleList([Block(), Passes(view), Block()])
    ref = copy.deepcopy(model)
    runner = runner_for(model)
    x = randn(2, 5, 8)
    loss = stepped(runner, lambda: trained(model, x))
    assert_bitwise(trained(ref, x), grads(ref), loss, grads(model))


@pytest.mark.parametrize("by_type", [True, False])
def test_the_walk_finds_the_leaves_by_node_type_or_by_asking_each_node(monkeypatch, by_type):
    # On a torch that does not expose the accumulator's type, each node is asked for a
    # ``variable``: the same leaves either way, each once, the known ones left out.
    from chameleon_swap.recompute import full
    if not by_type:
        monkeypatch.setattr(full, "_ACCUMULATE", None)
    a, b, c = (torch.randn(3, requires_grad=True) for _ in range(3))
    x = torch.randn(3, requires_grad=True)
    y = ((x * a).sin() * b + a * c).sum()
    known = {id(x)}
    found = full._foreign([y], [x], known, False)
    assert sorted(id(t) for t in found) == sorted(id(t) for t in (a, b, c))
    assert len(found) == 3 and known == {id(t) for t in (x, a, b, c)}
    assert full._foreign([y], [x], known, False) == []


class Dropped(Block):
    def forward(self, x, scale=None):
        return super().forward(nn.functional.dropout(x, 0.3, self.training), scale)


@pytest.mark.parametrize("autocast", [False, True])
def test_the_rng_is_restored_only_for_a_block_that_drew_from_it(monkeypatch, autocast):
    # A block without dropout draws nothing: its recompute neither forks nor resets the RNG.
    # One with dropout gets its forward's masks back, and the step's RNG ends where the plain
    # step's does. Under autocast the recompute runs under it too (bfloat16 on the CPU).
    forks = []
    real = torch.random.fork_rng
    monkeypatch.setattr(torch.random, "fork_rng", lambda *a, **k: forks.append(1) or real(*a, **k))

    def build():
        torch.manual_seed(5)
        m = nn.Module()
        m.layers = nn.ModuleList([Block(), Dropped(), Block()])
        return m

    model, ref = build(), build()
    runner = BlockRunner(model, "layers", mode_fn=lambda b: "full", accountant=Books())
    runner.install()
    x = randn(2, 5, 8)
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else \
        contextlib.nullcontext

    def step(m):
        torch.manual_seed(3)
        with ctx():
            h = x
            for layer in m.layers:
                h = layer(h)
            loss = h.float().pow(2).mean()
        loss.backward()
        return loss.detach(), torch.rand(3)

    got = stepped(runner, lambda: step(model))
    want = step(ref)
    assert len(forks) == 1                      # the dropout block's recompute only
    assert torch.equal(got[1], want[1])         # the RNG where the plain step leaves it
    assert_bitwise(want[0], grads(ref), got[0], grads(model))

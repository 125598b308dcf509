"""Weight offload (``chameleon_swap.parallel.weights``): blocks' parameters kept on the host between uses.

Every run is compared with the same code without offload: losses, every gradient and the weights
after the optimizer ``torch.equal``, over several steps, with micro-batch accumulation, frozen and
unused parameters, a user's checkpoint (a forward inside backward) and the activation engine on
top. The weight bytes on the device are read inside every block's forward and backward: never
more than two blocks (the one running and the next one coming back). The CPU copy engine's
workers are slowed down where noted, so a missing wait reads wrong bytes instead of passing by
luck. The CUDA test at the end (skipped without a GPU) checks the stream ordering.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import chameleon_swap as cs
from chameleon_swap.copy.cpu import CpuCopyEngine
from chameleon_swap.parallel.weights import WeightOffload

D = 16


class Block(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.scale = nn.Parameter(torch.ones(d))
        self.extra = nn.Linear(d, d)       # used only when the model asks (unused parameters)
        self.use_extra = True

    def forward(self, x):
        h = self.fc2(torch.relu(self.fc1(self.norm(x)))) * self.scale
        if self.use_extra:
            h = h + self.extra(x).t().t()  # a view of an activation, and weight.t() saved
        return x + h


class Net(nn.Module):
    def __init__(self, n: int = 4, ckpt: bool = False, repeat: bool = False, d: int = D) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 3)
        self.ckpt, self.repeat = ckpt, repeat

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=False) if self.ckpt else layer(h)
        if self.repeat:
            h = self.layers[1](h)          # a block run twice in one forward
        return self.head(h).square().mean()


def _pair(**kw):
    torch.manual_seed(0)
    ref = Net(**kw)
    return ref, copy.deepcopy(ref)


def _batches(n=3, b=5):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(b, 8, generator=g) for _ in range(n)]


def _assert_same(ref: nn.Module, got: nn.Module, what: str) -> None:
    for (name, p), q in zip(ref.named_parameters(), got.parameters()):
        assert torch.equal(p, q), f"{what}: weight {name} differs"
        assert (p.grad is None) == (q.grad is None), f"{what}: grad of {name} None on one side"
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), f"{what}: gradient of {name} differs"


def _watch(off: WeightOffload, model: Net) -> list:
    """Weight bytes on the device at every block's forward and at the start of its backward
    (the hooks run after the offload's own, which were registered first)."""
    seen = []

    def pre(m, args):
        seen.append(("F", off.resident_bytes, off.held_bytes))

    def post(m, args, out):
        if out.requires_grad:
            out.register_hook(lambda g: seen.append(("B", off.resident_bytes, off.held_bytes)))

    for layer in model.layers:
        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post)
    return seen


def _train(model, batches, off=None, opt_steps=True, micro=1, settle=False):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x in batches:
        ctx = off.step() if off is not None else _null()
        with ctx:
            if settle and off is not None:
                off.copy.synchronize()     # the step's copy-outs done: a deterministic bound
            for xm in x.tensor_split(micro):
                loss = model(xm)
                loss.backward()
                losses.append(loss.detach())
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        if opt_steps:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return losses, grads


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("micro", [1, 3])
def test_bitwise_over_steps_within_two_blocks(micro):
    ref, got = _pair()
    want, _ = _train(ref, _batches(), micro=micro)
    copy_engine = CpuCopyEngine(delay_s=0.0005)
    off = WeightOffload(list(got.layers), copy=copy_engine, model=got)
    seen = _watch(off, got)
    try:
        have, _ = _train(got, _batches(), off, micro=micro, settle=True)
    finally:
        off.close()
        copy_engine.close()
    assert len(want) == len(have) == 3 * micro
    for a, b in zip(want, have):
        assert torch.equal(a, b)
    _assert_same(ref, got, "after 3 steps")
    two = 2 * max(off.block_bytes)
    assert {k for k, _, _ in seen} == {"F", "B"}
    assert max(n for _, n, _ in seen) <= two, seen
    assert 0 < off.last_step.peak_held_bytes <= off.last_step.peak_bytes <= two
    assert off.last_step.fetched_bytes > 0 and off.last_step.offloaded_bytes == sum(off.block_bytes)
    assert off.resident_bytes == sum(off.block_bytes)      # all back between steps


def test_grads_of_one_step_without_optimizer():
    ref, got = _pair()
    _train(ref, _batches(1), opt_steps=False)
    off = WeightOffload(list(got.layers), model=got)
    try:
        _train(got, _batches(1), off, opt_steps=False)
    finally:
        off.close()
    _assert_same(ref, got, "one step")
    for p in got.parameters():
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()


@pytest.mark.parametrize("case", ["frozen_some", "frozen_block", "unused", "checkpoint",
                                  "repeat"])
def test_frozen_unused_recomputed_and_repeated_blocks(case):
    kw = {"ckpt": case == "checkpoint", "repeat": case == "repeat"}
    ref, got = _pair(**kw)
    for m in (ref, got):
        if case == "frozen_some":
            m.layers[1].norm.requires_grad_(False)
            m.layers[2].scale.requires_grad_(False)
        elif case == "frozen_block":
            m.layers[2].requires_grad_(False)
        elif case == "unused":
            m.layers[1].use_extra = False
    want, _ = _train(ref, _batches())
    off = WeightOffload(list(got.layers), copy=CpuCopyEngine(delay_s=0.0005), model=got)
    seen = _watch(off, got)
    try:
        have, _ = _train(got, _batches(), off, settle=True)
    finally:
        off.close()
        off.copy.close()
    assert all(torch.equal(a, b) for a, b in zip(want, have))
    _assert_same(ref, got, case)
    # Frozen or unused parameters: a block is released when the gradient reaches the next
    # one instead of by the gradient hooks, before the next one's weights come back.
    two = 2 * max(off.block_bytes)
    assert max(n for _, n, _ in seen) <= two, seen
    assert off.last_step.peak_bytes <= two


def test_under_the_activation_engine():
    ref, got = _pair()
    want, _ = _train(ref, _batches())
    off = WeightOffload(list(got.layers), copy=CpuCopyEngine(delay_s=0.0005), model=got)
    seen = _watch(off, got)
    losses = []
    opt = torch.optim.AdamW(got.parameters(), lr=1e-2)
    with cs.Chameleon(budget=0, device="cpu", min_tensor_bytes=0) as eng:
        for x in _batches():
            with eng.step(), off.step():
                loss = got(x)
                loss.backward()
            losses.append(loss.detach())
            assert eng.last_step.offloaded_bytes > 0          # activations moved too
            opt.step()
            opt.zero_grad(set_to_none=True)
    off.close()
    off.copy.close()
    assert all(torch.equal(a, b) for a, b in zip(want, losses))
    _assert_same(ref, got, "with Chameleon")
    # Copies not waited for: blocks may linger while their copy-out runs, but at most two
    # blocks fetched or run in the step are ever held.
    assert max(h for _, _, h in seen) <= 2 * max(off.block_bytes), seen
    assert off.last_step.peak_held_bytes <= 2 * max(off.block_bytes)


def test_no_grad_forward_releases_every_block():
    _, got = _pair()
    off = WeightOffload(list(got.layers), model=got)
    with torch.no_grad():
        want = got(_batches(1)[0])
        with off.step():
            out = got(_batches(1)[0])
            assert off.resident_bytes == 0       # each block let go after its forward
    assert torch.equal(want, out)
    assert off.resident_bytes == sum(off.block_bytes)
    off.close()


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_exception_inside_a_step_leaves_the_model_whole(where):
    ref, got = _pair()
    off = WeightOffload(list(got.layers), copy=CpuCopyEngine(delay_s=0.0005), model=got)

    def boom(*args):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with off.step():
            if where == "forward":
                h = got.layers[2].register_forward_pre_hook(boom)
                try:
                    got(_batches(1)[0])
                finally:
                    h.remove()
            else:
                loss = got(_batches(1)[0])
                loss.register_hook(boom)
                loss.backward()
    assert off.last_step.failed
    _assert_same(ref, got, "after the failed step")
    # The model goes on as if nothing happened, with and without offload.
    want, _ = _train(ref, _batches())
    have, _ = _train(got, _batches(), off)
    off.close()
    off.copy.close()
    assert all(torch.equal(a, b) for a, b in zip(want, have))
    _assert_same(ref, got, "after training on")


def test_a_missed_fetch_fails_loudly():
    _, got = _pair()
    off = WeightOffload(list(got.layers), model=got)
    x = torch.randn(2, D)
    with off.step():
        got(_batches(1)[0]).backward()
        # Reached without the block's hooks (a submodule called directly): the weights are not
        # on the device, and the use is an error, not a read of freed memory.
        with pytest.raises(RuntimeError):
            got.layers[0].fc1(x)
    assert got.layers[0].fc1(x).shape == (2, 2 * D)      # back after the step
    off.close()


def test_tied_parameters_are_refused():
    torch.manual_seed(0)
    net = Net()
    net.layers[2].fc1 = net.layers[0].fc1
    with pytest.raises(ValueError, match="blocks 0 and 2 share a parameter"):
        WeightOffload(list(net.layers))
    net = Net()
    net.head.weight = nn.Parameter(net.layers[3].fc2.weight.detach()[:3])  # same storage
    with pytest.raises(ValueError, match=r"model\.head\.weight shares its storage .* block 3"):
        WeightOffload(list(net.layers), model=net)
    WeightOffload(list(net.layers)).close()     # without model= it cannot know


def test_clear_errors():
    net = Net()
    with pytest.raises(TypeError, match="blocks must be a list of nn.Module"):
        WeightOffload(net)
    with pytest.raises(TypeError, match="non-empty list"):
        WeightOffload([])
    with pytest.raises(ValueError, match="hold no parameters"):
        WeightOffload([nn.ReLU(), nn.ReLU()])
    with pytest.raises(ValueError, match="must not nest"):
        WeightOffload([net.layers[0], net.layers[0].fc1])
    with pytest.raises(ValueError, match="device=meta"):
        WeightOffload(list(net.layers), device="meta")
    off = WeightOffload(list(net.layers))
    with off.step():
        with pytest.raises(RuntimeError, match="already under way"):
            off.begin_step()
    assert "WeightOffload(blocks=4" in repr(off)
    off.close()
    net.layers[0](torch.randn(2, D))            # hooks removed: a plain model again


# ---------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stream_ordering_and_memory():
    """The copy-out of each step waits for the optimizer's writes (delayed here by a sleep on
    the compute stream: a copy that did not wait would save the old weights and the next steps'
    gradients would differ), compute waits for the copies back, and released blocks really
    leave the device (the caching allocator's count)."""
    torch.manual_seed(0)
    ref = Net(n=6, d=512).cuda()          # about 5 MiB of weights a block
    got = copy.deepcopy(ref)
    xs = [x.cuda() for x in _batches(3, b=64)]

    def run(model, off):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = []
        for x in xs:
            with off.step() if off is not None else _null():
                loss = model(x)
                loss.backward()
            out.append(loss.detach())
            torch.cuda._sleep(20_000_000)          # the optimizer's writes come late
            opt.step()
            opt.zero_grad(set_to_none=True)
        return out

    want = run(ref, None)
    off = WeightOffload(list(got.layers), model=got)
    have = run(got, off)
    assert all(torch.equal(a, b) for a, b in zip(want, have))
    _assert_same(ref, got, "cuda")
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    with torch.no_grad(), off.step():
        got(xs[0])
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= start - sum(off.block_bytes) + 2**20
    assert torch.cuda.memory_allocated() >= start
    off.close()


@dataclasses.dataclass
class _Hidden:
    h: torch.Tensor


class _OpaqueBlock(nn.Module):
    """Returns its output inside an object the offload cannot look into, and keeps an auxiliary
    loss on itself: autograd reaches its weights with no hook on its outputs having fired."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.gate = nn.Linear(D, D)
        self.aux = None

    def forward(self, x):
        h = x + torch.tanh(self.fc(x))
        self.aux = self.gate(h).square().mean()
        return _Hidden(h)


class _OpaqueNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_OpaqueBlock() for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).h
        return x.square().mean() + sum(layer.aux for layer in self.layers)


@pytest.mark.parametrize("engine", [False, True], ids=["alone", "under-chameleon"])
def test_weights_read_where_no_output_hook_sees_it_are_fetched_first(engine):
    """Without the offload's saved-tensor wrapper a saved ``weight.t()`` of a released block is
    read from a storage of size 0 (an error at best); without the hook on each parameter's
    gradient, the accumulation meets an emptied parameter. Both fetch the block first."""
    torch.manual_seed(0)
    ref = _OpaqueNet()
    got = copy.deepcopy(ref)
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(2))
    want = ref(x)
    want.backward()
    off = WeightOffload(list(got.layers), copy=CpuCopyEngine(delay_s=0.0005), model=got)
    eng = cs.Chameleon(budget=0, device="cpu", min_tensor_bytes=0) if engine else None
    with (eng.step() if engine else _null()), off.step():
        loss = got(x)
        loss.backward()
    assert torch.equal(want, loss)
    _assert_same(ref, got, "opaque outputs")
    assert off.last_step.sync_fetches > 0            # fetched where it was read
    off.close()
    off.copy.close()
    if eng is not None:
        eng.close()

"""The engine on a CUDA device: the CPU engine matrix again, plus what only a GPU can show.

* Bitwise: the tiny Llama, the MoE and ``ViewsModel`` at 100/50/20/5/0% of their natural peak, for
  every policy the engine offers; every loss and gradient ``torch.equal`` to the run without the
  engine, every step within its budget (``_helpers.compare`` with ``device="cuda"``). The same
  under ``torch.autocast`` in bf16 and fp16, and with the whole step on a user's side stream.
* Memory, measured by the caching allocator rather than by the engine: offloaded activations
  really leave the device; with ``device_memory_limit`` the step's ``max_memory_allocated`` stays
  under the limit from the second step on (the first one learns the non-activation peak).
* Mechanism (docs/ARCHITECTURE.md, LESSONS 1, 2, 7, 8): no ``record_stream``; the pinned host arena is reused
  across steps with no fresh pinned allocation; no host synchronisation inside a step beyond what
  the model itself does; ``stall_seconds`` is a finite, non-negative part of the step.
* The CUDA sanitizer (CSAN): a small bitwise scenario in a child interpreter with
  ``TORCH_CUDA_SANITIZER=1`` reports no data race, and a deliberate race in the same harness is
  reported (so "no report" means something). The whole file can also be run with
  ``TORCH_CUDA_SANITIZER=1``: the tests themselves order every cross-stream use.

Everything skips without a CUDA device. The reference runs use the same kernels on the same
stream, so bitwise equality holds on a GPU whose kernels are deterministic for these shapes, which
``test_reference_is_deterministic`` checks first: if it fails, the bitwise failures are the GPU's,
not the engine's.
"""
from __future__ import annotations

import copy
import gc
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import chameleon_swap as cs
from chameleon_swap.config import POLICIES
from chameleon_swap.copy.bandwidth import cached_bandwidth
from chameleon_swap.workloads import Llama, LlamaConfig, MoE, MoEConfig

from _csan_scripts import CSAN_RACE, CSAN_SCENARIO
from _helpers import assert_bitwise, compare, grads, natural_peak, train_step
from _models import ViewsModel, randn

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
FRACTIONS = [1.0, 0.5, 0.2, 0.05, 0.0]
TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
# Big enough that activations (~88 MiB per step) dwarf allocator rounding and the engine's 1 MiB
# of slack, small enough for any GPU.
MEDIUM = dict(vocab_size=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=512)
TESTS_DIR = Path(__file__).resolve().parent
SRC_DIR = TESTS_DIR.parent / "src"


# --------------------------------------------------------------------------- models and batches
def tokens(cfg, B, T, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(cfg.vocab_size, (B, T + 1), generator=g)
    return t[:, :-1].to(DEV), t[:, 1:].to(DEV)


def llama(cfg=TINY):
    torch.manual_seed(0)                       # init_weights draws from the global CPU generator
    return Llama(LlamaConfig(**cfg)).to(DEV)


def moe():
    torch.manual_seed(0)
    return MoE(MoEConfig(**TINY, n_experts=4, top_k=2)).to(DEV)


def views():
    return ViewsModel().to(DEV)                # weights from its own seeded CPU generator


def lm_batches(model, lengths, B=2):
    return [tokens(model.config, B, T, seed=i) for i, T in enumerate(lengths)]


def dense_batches(lengths, B=2, dim=16):
    return [(randn(B, T, dim, seed=i).to(DEV),) for i, T in enumerate(lengths)]


# name -> (model factory, batches factory). Lengths repeat so the planned policies see a sequence
# again (a cached plan is applied) as well as a new one.
MODELS = {
    "llama": (llama, lambda m: lm_batches(m, [12, 20, 12])),
    "moe": (moe, lambda m: lm_batches(m, [12, 20, 7, 12])),
    "views": (views, lambda m: dense_batches([6, 11, 6])),
}


def engine(budget, **kw):
    kw.setdefault("min_tensor_bytes", 0)
    return cs.Chameleon(budget, device=DEV, **kw)


def check_stats(history, budget=None):
    """What every CUDA step must report, whatever the scenario."""
    for s in history:
        assert not s.failed, s
        assert isinstance(s.stall_seconds, float), s
        assert math.isfinite(s.stall_seconds) and s.stall_seconds >= 0.0, s
        assert math.isfinite(s.step_seconds) and s.step_seconds >= 0.0, s
        # Stalls are disjoint stretches of the step (device waits are timed on the compute stream
        # between events recorded inside the step; host waits happen inside it too).
        assert s.stall_seconds <= s.step_seconds + 1e-3, s
        assert 0 <= s.late_prefetches <= s.sync_fetches, s
        if budget is not None:
            assert s.peak_resident_bytes <= budget, s


@pytest.fixture(autouse=True)
def _cuda_clean():
    """Each test starts with no stream work pending and gives its cached blocks back, so the
    memory measurements of one test do not see another's leftovers."""
    torch.cuda.synchronize()
    yield
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture
def math_attention():
    """The math attention backend for the MEDIUM model's bitwise checks: the memory-efficient
    kernel's backward may split the keys and accumulate with atomics at T=256 (non-deterministic
    by design), which would fail a bitwise comparison with or without the engine. The tiny models
    keep the default backends (one key block: deterministic), so their saved tensors are the
    fused kernels' own (output, logsumexp, RNG state)."""
    with sdpa_kernel([SDPBackend.MATH]):
        yield


# --------------------------------------------------------------------------- determinism first
@pytest.mark.parametrize("name", list(MODELS))
def test_reference_is_deterministic(name):
    """Without the engine, the same step twice gives the same bits on this GPU: otherwise no
    bitwise comparison below could mean anything."""
    make, make_batches = MODELS[name]
    model = make()
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    for batch in make_batches(model):
        a.zero_grad(set_to_none=True)
        b.zero_grad(set_to_none=True)
        la, lb = train_step(a, batch), train_step(b, batch)
        assert_bitwise(la, grads(a), lb, grads(b))


def test_reference_is_deterministic_medium(math_attention):
    model = llama(MEDIUM)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    batch = lm_batches(model, [256], B=4)[0]
    assert_bitwise(train_step(a, batch), grads(a), train_step(b, batch), grads(b))


# --------------------------------------------------------------------------- the bitwise matrix
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("name", list(MODELS))
def test_bitwise_under_budget(name, fraction, policy):
    make, make_batches = MODELS[name]
    model = make()
    batches = make_batches(model)
    history, peaks, budget = compare(model, batches, fraction, device=DEV, policy=policy)
    assert len(history) == len(batches)
    assert all(s.budget_bytes == budget for s in history)
    check_stats(history, budget)
    if fraction < 1.0:
        assert sum(s.offloaded_bytes for s in history) > 0   # the budget really forced moves
        assert sum(s.host_peak_bytes for s in history) > 0
    if fraction == 0.0:
        assert all(s.peak_resident_bytes == 0 for s in history)


@pytest.mark.parametrize("fraction", [None, 0.3])
def test_explicit_device_forms(fraction):
    """'cuda', 'cuda:<i>' and a torch.device all name the same engine device."""
    index = torch.cuda.current_device()
    model = llama()
    batches = lm_batches(model, [10])
    for device in ("cuda", f"cuda:{index}", torch.device("cuda", index)):
        with cs.Chameleon(None, device=device) as eng:
            assert eng.device == torch.device("cuda", index)
        history, _, budget = compare(model, batches, fraction, device=device)
        check_stats(history, budget)


@pytest.mark.parametrize("fraction", [1.0, 0.2, 0.0])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_bitwise(dtype, name, fraction):
    if dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    make, make_batches = MODELS[name]
    model = make()
    batches = make_batches(model)[:2]
    saved_dtypes = set()

    def loss_fn(m, b):
        with torch.autocast("cuda", dtype=dtype):
            return m(*b)

    history, peaks, budget = compare(model, batches, fraction, device=DEV, loss_fn=loss_fn)
    check_stats(history, budget)
    if fraction < 1.0:
        assert sum(s.offloaded_bytes for s in history) > 0
    # The scenario is what it claims: autocast really saved low-precision activations.
    with engine(None) as eng:
        pack = eng._ex.pack

        def spy(t):
            saved_dtypes.add(t.dtype)
            return pack(t)

        eng._ex.pack = spy
        train_step(copy.deepcopy(model), batches[0], eng, loss_fn)
    assert dtype in saved_dtypes, saved_dtypes


def test_user_side_stream():
    """The whole step on a stream of the user's: the engine orders its copies against the
    stream current when a tensor is saved or needed, not against the default stream."""
    for name in ("llama", "views"):
        make, make_batches = MODELS[name]
        model = make()
        batches = make_batches(model)
        budget = int(min(natural_peak(model, b, device=DEV) for b in batches) * 0.2)
        ref, test = copy.deepcopy(model), copy.deepcopy(model)
        side = torch.cuda.Stream()
        main = torch.cuda.current_stream()
        with engine(budget) as eng:
            for b in batches:
                ref.zero_grad(set_to_none=True)
                test.zero_grad(set_to_none=True)
                side.wait_stream(main)              # inputs and weights were written on main
                with torch.cuda.stream(side):
                    l_ref = train_step(ref, b)
                    loss = train_step(test, b, eng)
                main.wait_stream(side)              # losses and gradients were written on side
                assert_bitwise(l_ref, grads(ref), loss, grads(test))
                torch.cuda.synchronize()            # reads on main done before side reuses memory
                check_stats([eng.last_step], budget)
                assert eng.last_step.offloaded_bytes > 0
                assert eng.host_bytes_in_use == 0 and eng.resident_bytes == 0


# --------------------------------------------------------------------------- memory, measured by the allocator
def _allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def test_offloaded_activations_leave_the_device():
    """After forward, with every copy done, the allocator holds the saved activations at budget
    None and (almost) none of them at budget 0: the engine's residency, checked from outside."""
    model = llama(MEDIUM)
    batch = lm_batches(model, [256], B=4)[0]
    # The token tensors are saved (by the embedding and the loss) but were allocated before.
    inputs = sum(t.untyped_storage().nbytes() for t in batch)
    held, saved = {}, {}
    for budget in (None, 0):
        with engine(budget) as eng:
            start = _allocated()
            with eng.step():
                loss = model(*batch)
                eng._copy.synchronize()             # every copy-out done, device sides dropped
                held[budget] = _allocated() - start
                resident = eng.resident_bytes
                loss.backward()
            del loss
            model.zero_grad(set_to_none=True)
            s = eng.last_step
            saved[budget] = s.saved_bytes
            assert resident == (s.saved_bytes if budget is None else 0), (resident, s)
            assert eng.host_bytes_in_use == 0 and eng.resident_bytes == 0
    assert saved[None] == saved[0] > 50 * 2**20
    assert held[None] >= saved[None] - inputs       # everything saved is on the device
    # At budget 0 what stays is the loss and allocator rounding, not activations.
    assert held[None] - held[0] >= 0.95 * saved[None], (held, saved)
    assert held[0] <= 0.05 * saved[None], (held, saved)


@pytest.mark.parametrize("policy", POLICIES)
def test_device_memory_limit_holds_from_the_second_step(policy, math_attention):
    # The planned policies measure copy bandwidth (64 MiB on the device) once per process, the
    # first time they plan, at the end of a step; measure it now so this test is about steps.
    cached_bandwidth(DEV)
    model = llama(MEDIUM)
    B, T, steps = 4, 256, 4
    batches = [tokens(model.config, B, T, seed=i) for i in range(steps)]   # one shape, new tokens

    # Reference losses and gradients, kept on the host so they take no device memory.
    ref = copy.deepcopy(model)
    expected = []
    for b in batches:
        ref.zero_grad(set_to_none=True)
        loss = train_step(ref, b)
        expected.append((loss.cpu(), {n: None if g is None else g.cpu()
                                      for n, g in grads(ref).items()}))
    del ref, loss

    test = copy.deepcopy(model)
    # The step's natural device footprint above what is allocated when it begins ...
    base = _allocated()
    torch.cuda.reset_peak_memory_stats()
    train_step(test, batches[0])
    natural = torch.cuda.max_memory_allocated() - base
    test.zero_grad(set_to_none=True)
    # ... and the smallest the engine can make it (budget 0: every activation on the host).
    with engine(0) as eng0:
        base0 = _allocated()
        torch.cuda.reset_peak_memory_stats()
        train_step(test, batches[0], eng0)
        floor = torch.cuda.max_memory_allocated() - base0
        activations = eng0.last_step.saved_bytes
    test.zero_grad(set_to_none=True)

    # Room for the smallest footprint plus 30% of the activations above what is allocated when
    # the engine starts: feasible, and binding.
    start = _allocated()
    limit = start + floor + int(0.3 * activations) + 2**20
    assert start + natural > limit, ("scenario too small for the limit to bind",
                                     start, natural, floor, activations)

    with engine(None, device_memory_limit=limit, policy=policy) as eng:
        for i, b in enumerate(batches):
            test.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            loss = train_step(test, b, eng)
            peak = torch.cuda.max_memory_allocated()    # the engine reset it when the step began
            s = eng.last_step
            assert s.peak_device_bytes is not None and s.peak_device_bytes <= peak, (peak, s)
            assert s.budget_bytes is not None, s
            assert s.peak_resident_bytes <= s.budget_bytes, s
            check_stats([s], s.budget_bytes)
            if i >= 1:
                assert peak <= limit, (f"step {i}: {cs.format_bytes(peak)} allocated at most, over "
                                       f"device_memory_limit={cs.format_bytes(limit)} "
                                       f"(allocated at start {cs.format_bytes(start)})", s)
            assert s.offloaded_bytes > 0, s            # a binding limit cannot hold otherwise
            exp_loss, exp_grads = expected[i]
            assert_bitwise(exp_loss, exp_grads, loss.cpu(),
                           {n: None if g is None else g.cpu() for n, g in grads(test).items()})


@pytest.mark.parametrize("budget,limit,expected", [
    (None, 1, 0),             # less than is already allocated: nothing may stay resident
    (1000, 2**50, 1000),      # a limit far away: the explicit budget is the smaller one
    (0, 2**50, 0),
])
def test_device_memory_limit_and_budget_combine(budget, limit, expected):
    model = llama()
    batches = lm_batches(model, [12, 16])
    ref, test = copy.deepcopy(model), copy.deepcopy(model)
    with engine(budget, device_memory_limit=limit) as eng:
        for b in batches:
            ref.zero_grad(set_to_none=True)
            test.zero_grad(set_to_none=True)
            l_ref, loss = train_step(ref, b), train_step(test, b, eng)
            assert_bitwise(l_ref, grads(ref), loss, grads(test))
            s = eng.last_step
            assert s.budget_bytes == expected, s
            assert s.peak_resident_bytes <= expected, s
            assert s.peak_device_bytes is not None and s.peak_device_bytes > 0, s
            check_stats([s], expected)


# --------------------------------------------------------------------------- mechanism
def test_no_record_stream(monkeypatch):
    """LESSONS 7: frees are ordered by events, never by ``record_stream`` (which fragments the
    caching allocator). Checked at run time, at budgets that copy in both directions."""
    calls = []
    real = torch.Tensor.record_stream

    def spy(self, stream):
        calls.append((tuple(self.shape), stream))
        return real(self, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", spy)
    for name in ("llama", "views"):
        make, make_batches = MODELS[name]
        model = make()
        for fraction in (0.3, 0.0):
            history, _, budget = compare(model, make_batches(model), fraction, device=DEV)
            assert sum(s.offloaded_bytes for s in history) > 0
            assert sum(s.prefetched_bytes + s.fetched_bytes for s in history) > 0
    assert calls == []
    # And nowhere in the package's source.
    pkg = Path(cs.__file__).parent
    offenders = [str(p) for p in pkg.rglob("*.py")
                 if re.search(r"\.record_stream\s*\(", p.read_text())]
    assert offenders == []


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="reads MemAvailable")
def test_a_closed_engine_gives_its_pinned_memory_back_to_the_machine():
    """On an H200 (torch 2.11) two closed engines' pinned arenas (about 80 GiB) stayed out of
    MemAvailable until the process ended, and the next engines' default host_memory_limit fell
    to 11 GiB. Here an engine pins 2 GiB (``host_memory_reserve``), runs a step that offloads
    into it, and closes: MemAvailable comes back within 512 MiB of where it was."""
    from chameleon_swap.config import available_host_memory
    GiB = 2**30
    model = llama()
    batch = lm_batches(model, [16])[0]
    gc.collect()
    before = available_host_memory()
    eng = engine(0, host_memory_reserve="2GiB")
    try:
        assert eng._pool.wait_reserve(timeout=120)
        train_step(model, batch, eng)
        model.zero_grad(set_to_none=True)
        assert eng.last_step.offloaded_tensors > 0
        held = before - available_host_memory()
        assert held > 1.5 * GiB, held                    # the reserve really is pinned
    finally:
        eng.close()
    del eng
    gc.collect()
    assert before - available_host_memory() < GiB // 2, (before, available_host_memory())


def test_pinning_in_the_step_is_timed_as_a_wait_not_as_compute(monkeypatch):
    """An arena growing on the step's thread leaves the compute stream idle; the slots are timed
    by the device, so that gap read as compute (on the H100 a first step that pinned 8 GiB
    read as 16 s of compute). ``host_block`` times it with events as a wait instead. The
    allocator is slowed on purpose (the testing hook), so the gap dwarfs the tiny model's
    kernels."""
    from chameleon_swap.copy import host_pool
    monkeypatch.setenv(host_pool.ALLOC_DELAY_ENV, "40")          # 2 MiB slab: 78 ms
    model = llama()
    batch = lm_batches(model, [16])[0]
    with engine(0) as eng:
        train_step(model, batch, eng)
        model.zero_grad(set_to_none=True)
        p, s = eng._profiler.last_profile, eng.last_step
    assert p.detailed and s.offloaded_tensors > 0 and s.host_wait_seconds > 0.05, s
    assert sum(p.waits) > 0.5 * s.host_wait_seconds, (p.waits, s.host_wait_seconds)
    assert sum(p.compute) < s.step_seconds - 0.5 * s.host_wait_seconds, (p.compute, s)


def test_pinned_pool_is_reused_across_steps(monkeypatch):
    """LESSONS 8: host buffers are ranges of pinned slabs kept by the arena, and the next step of
    the same shape takes them from the arena: no fresh pinned allocation at all after the first
    step. At budget 0 every saved tensor goes to the host in forward and none comes back before
    backward, so the set of buffers a step needs is the same every time."""
    model = llama()
    batches = lm_batches(model, [16, 16, 16, 16])          # one shape, new tokens each step
    with engine(0) as eng:
        pool = eng._pool
        train_step(model, batches[0], eng)
        model.zero_grad(set_to_none=True)
        first = pool.allocations
        assert first > 0 and eng.last_step.offloaded_tensors > 0
        assert pool.in_use_bytes == 0 and eng.host_bytes_in_use == 0
        assert len(pool._slabs) == first and pool.cached_bytes == eng.host_bytes_reserved > 0
        assert all(slab.tensor.is_pinned() for slab in pool._slabs)

        pinned = []
        real_empty = torch.empty

        def counting_empty(*args, **kwargs):
            if kwargs.get("pin_memory"):
                pinned.append(args)
            return real_empty(*args, **kwargs)

        monkeypatch.setattr(torch, "empty", counting_empty)
        for b in batches[1:]:
            train_step(model, b, eng)
            model.zero_grad(set_to_none=True)
            assert pool.allocations == first, (pool.allocations, first)
            assert eng.host_bytes_in_use == 0
            assert eng.last_step.offloaded_tensors == eng.history[0].offloaded_tensors
        monkeypatch.undo()
        assert pinned == []


def _sync_warnings(fn) -> int:
    """How many synchronising CUDA operations ``fn`` performs, by torch's sync debug mode."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


@pytest.mark.parametrize("fraction", [None, 0.5, 0.0])
@pytest.mark.parametrize("name", list(MODELS))
def test_engine_adds_no_host_synchronisation(name, fraction):
    """docs/ARCHITECTURE.md: no host synchronisation inside a step on CUDA. The engine waits on the host only
    through events when the budget forces it (not flagged by the debug mode); it must add no
    ``.item()``, no pageable copy, no stream synchronize to what the model itself does."""
    make, make_batches = MODELS[name]
    model = make()
    batch = make_batches(model)[0]
    budget = None if fraction is None else int(natural_peak(model, batch, device=DEV) * fraction)
    ref, test = copy.deepcopy(model), copy.deepcopy(model)
    train_step(copy.deepcopy(model), batch)                  # warm-up: lazy inits, workspaces
    n_ref = _sync_warnings(lambda: train_step(ref, batch))
    with engine(budget) as eng:
        n_eng, loss = _step_sync_warnings(eng, test, batch)
        check_stats([eng.last_step], budget)
    assert n_eng <= n_ref, f"the engine added {n_eng - n_ref} synchronising operations"
    assert_bitwise(train_step(copy.deepcopy(model), batch), grads(ref), loss, grads(test))


def _step_sync_warnings(eng, model, batch) -> tuple:
    """The synchronising operations flagged in one step of ``eng`` training ``model`` on
    ``batch``, and the step's loss."""
    out = []
    with eng.step():
        def run():
            loss = model(*batch)
            loss.backward()
            out.append(loss.detach())
        n = _sync_warnings(run)
    return n, out[0]


def test_stall_seconds_with_late_copies(math_attention):
    """A budget that forces copies back during backward on a model big enough for them to take
    time: stalls are measured (finite, non-negative, within the step) on every step."""
    model = llama(MEDIUM)
    batches = lm_batches(model, [256, 192, 256], B=4)
    history, _, budget = compare(model, batches, 0.05, device=DEV)
    check_stats(history, budget)
    assert all(s.prefetched_bytes + s.fetched_bytes > 0 for s in history)
    assert all(isinstance(s.stall_seconds, float) for s in history)


# ----------------------------------------------------------------- keep, swap or recompute
# With ``model=`` the engine recomputes blocks as well as swapping them (recompute/full.py, torch's
# selective checkpointing). On a GPU that adds what a CPU cannot show: the CUDA generator's state
# put back for a recompute, autocast's casts made again on the device, the planner process beside
# a CUDA context. A link named 10 MB/s makes copies look slow, so planned steps tend to recompute.
SLOW_LINK = "10MB/s"


class DropBlock(nn.Module):
    """Dropout between two projections: a recompute that did not put the CUDA generator back
    would draw another mask, and its gradients would differ from the plain step's."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        return x + self.down(self.drop(torch.nn.functional.gelu(self.up(self.norm(x)))))


class DropNet(nn.Module):
    def __init__(self, dim: int = 64, n: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(DropBlock(dim) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


@pytest.mark.parametrize("fraction", [0.5, 0.2, 0.05])
@pytest.mark.parametrize("name", ["llama", "moe"])
def test_bitwise_with_recompute(name, fraction):
    make = {"llama": lambda: llama({**TINY, "n_layers": 3}), "moe": moe}[name]
    model = make()
    batches = lm_batches(model, [24, 24, 16, 24, 24])
    # Plans made on the step's thread, so that the later steps of 24 run them.
    history, _, budget = compare(model, batches, fraction, device=DEV, model_kwarg=True,
                                 link_bandwidth=SLOW_LINK, plan_in_background=False)
    check_stats(history, budget)
    # Which mix runs is the planner's call on the device's own times, so this asserts none: on an
    # H100 (2026-11-26) these launch-bound steps (32 ms) kept every block and swapped at 50%, where
    # the CPU recomputes. Two tests below (the dropout's, the synchronisation's) assert that
    # their steps recompute, and passed there.


def test_a_recomputed_dropout_draws_the_same_mask():
    model = DropNet().to(DEV)
    ref = copy.deepcopy(model)
    xs = [randn(4, 64, 64, seed=i).to(DEV) for i in range(5)]
    budget = int(natural_peak(model, (xs[0],), device=DEV) * 0.3)
    with engine(budget, model=model, link_bandwidth=SLOW_LINK, plan_in_background=False) as eng:
        for i, x in enumerate(xs):
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            torch.manual_seed(100 + i)               # the same dropout masks in both runs
            l_ref = train_step(ref, (x,))
            after_ref = torch.cuda.get_rng_state()
            torch.manual_seed(100 + i)
            loss = train_step(model, (x,), eng)
            assert_bitwise(l_ref, grads(ref), loss, grads(model))
            # The generator ends where the plain step left it: the recompute's draws are
            # replays, not new ones.
            assert torch.equal(torch.cuda.get_rng_state(), after_ref)
        history = list(eng.history)
    check_stats(history, budget)
    assert any(s.recomputed_bytes > 0 for s in history), history[-1]


def test_hugging_face_llama_in_bf16_with_the_planner_process():
    transformers = pytest.importorskip("transformers")
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(DEV)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(128, (2, T), generator=g).to(DEV) for T in [64, 96, 64, 64, 96, 64]]

    def loss_fn(m, ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return m(input_ids=ids, labels=ids).loss

    # The default: mode plans made in a planner process while the steps run.
    history, _, budget = compare(model, batches, 0.25, loss_fn=loss_fn, device=DEV,
                                 model_kwarg=True, link_bandwidth=SLOW_LINK)
    check_stats(history, budget)
    assert all(sum(s.block_modes) == 4 for s in history)      # LlamaDecoderLayer x 4


def test_recompute_adds_no_host_synchronisation():
    """The recompute path (the generator's state, the block's parameters, the replay) adds no
    host synchronisation to the plain step's either."""
    model = llama({**TINY, "n_layers": 3})
    batch = lm_batches(model, [24])[0]
    budget = int(natural_peak(model, batch, device=DEV) * 0.5)
    ref, test = copy.deepcopy(model), copy.deepcopy(model)
    train_step(copy.deepcopy(model), batch)                  # warm-up: lazy inits, workspaces
    n_ref = _sync_warnings(lambda: train_step(ref, batch))
    with engine(budget, model=test, link_bandwidth=SLOW_LINK, plan_in_background=False) as eng:
        for _ in range(3):                                   # planned from the second step on
            train_step(test, batch, eng)
        assert eng.last_step.recomputed_bytes > 0, eng.last_step
        test.zero_grad(set_to_none=True)
        n_eng, loss = _step_sync_warnings(eng, test, batch)
        check_stats([eng.last_step], budget)
        assert eng.last_step.recomputed_bytes > 0, eng.last_step
    assert n_eng <= n_ref, f"the engine added {n_eng - n_ref} synchronising operations"
    assert_bitwise(train_step(copy.deepcopy(model), batch), grads(ref), loss, grads(test))


# --------------------------------------------------------------------------- the CUDA sanitizer
def _run_sanitized(script: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["TORCH_CUDA_SANITIZER"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS_DIR), str(SRC_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, cwd=str(TESTS_DIR), timeout=900)


def test_sanitizer_catches_a_race_in_this_harness():
    """Control: the harness below would see a race (the sanitizer is on and reports to stderr)."""
    proc = _run_sanitized(CSAN_RACE)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "CSAN detected a possible data race" in proc.stderr, proc.stderr[-4000:]
    assert "RACE-NOT-REPORTED" not in proc.stdout


def test_bitwise_scenario_under_the_cuda_sanitizer():
    proc = _run_sanitized(CSAN_SCENARIO)
    report = f"rc={proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}"
    assert "CSAN" not in proc.stderr, report
    assert "data race" not in proc.stderr, report
    assert proc.returncode == 0, report
    assert "CSAN-SCENARIO-OK" in proc.stdout, report

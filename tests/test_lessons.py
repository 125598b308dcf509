"""One test (or a few) per line of docs/LESSONS.md: bugs that shipped in public offloading
projects, each checked here so that it fails if the bug comes back.

CPU only. The CPU copy engine's two worker threads stand in for the CUDA copy streams (same
ordering and lifetime rules, optional delays so a missing wait shows as wrong bytes), so the CUDA
parts of a lesson are tested through their CPU analogue here, and on a GPU in a separate file.
"""
from __future__ import annotations

import copy
import gc
import io
import tokenize
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import chameleon_swap as cs
from chameleon_swap.copy.bandwidth import measure_bandwidth
from chameleon_swap.copy.cpu import CpuCopyEngine
from chameleon_swap.runtime.executor import HOST, OFFLOADING, RESIDENT
from chameleon_swap.policy import POLICIES
from chameleon_swap.workloads import Llama, LlamaConfig, MoE, MoEConfig

from _helpers import assert_bitwise, grads, natural_peak, train_step
from _models import FunctionalModel, ViewsModel, randn

TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")   # see conftest.py


def engine(budget, **kw):
    kw.setdefault("min_tensor_bytes", 0)
    return cs.Chameleon(budget, device="cpu", **kw)


def llama():
    torch.manual_seed(0)
    return Llama(LlamaConfig(**TINY))


def moe():
    torch.manual_seed(0)
    return MoE(MoEConfig(**TINY, n_experts=4, top_k=2))


def tokens(model, B, T, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(model.config.vocab_size, (B, T + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def param(*shape, seed=0, dtype=torch.float32):
    return nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype))


def run_fn(fn, params, eng=None):
    """Zero the grads of ``params``, run ``fn() -> loss`` and backward (inside ``eng.step()``)."""
    for p in params:
        p.grad = None
    if eng is None:
        loss = fn()
        loss.backward()
    else:
        with eng.step():
            loss = fn()
            loss.backward()
    return loss.detach(), {i: p.grad.clone() for i, p in enumerate(params)}


class PackSpy:
    """Wraps the executor's pack hook (``step()`` looks it up on entry) and keeps every packed
    tensor's metadata and a strong reference to its storage (so addresses are not reused)."""

    def __init__(self, eng):
        self.packed = []
        self.storages = []
        self._pack = eng._ex.pack
        eng._ex.pack = self

    def __call__(self, t):
        self.packed.append(dict(size=tuple(t.size()), stride=t.stride(), offset=t.storage_offset(),
                                dtype=t.dtype, contiguous=t.is_contiguous(),
                                channels_last=t.dim() == 4 and t.is_contiguous(
                                    memory_format=torch.channels_last),
                                conj=t.is_conj(), neg=t.is_neg(), ptr=t.untyped_storage().data_ptr(),
                                nbytes=t.untyped_storage().nbytes(), param=isinstance(t, nn.Parameter)
                                or (t._base is not None and isinstance(t._base, nn.Parameter))))
        self.storages.append(t.untyped_storage())
        return self._pack(t)


# =========================================================================== lesson 1
class OffloadWatch:
    """Wraps the copy engine's ``offload``: a weak reference to every source with its ticket, and a
    check that no source is gone while its copy is still pending."""

    def __init__(self, eng):
        self.copy = eng._copy
        self.entries = []
        self.checks = 0
        self.pending_seen = 0
        real = self.copy.offload

        def offload(src, dst, ready):
            ticket = real(src, dst, ready)
            self.entries.append((weakref.ref(src), ticket))
            return ticket

        self.copy.offload = offload

    def check(self):
        for ref, ticket in self.entries:
            if not ticket.done():
                self.pending_seen += 1
                assert ref() is not None, "a device tensor was freed before its copy to host completed"
        self.checks += 1


def test_lesson_01_slow_copies_keep_the_source_alive_and_gradients_bitwise(monkeypatch):
    """LESSONS 1: "A device tensor freed or reused before its copy to host completed gave NaN
    gradients with streams on (torchtune #1867). Keep it alive until the copy event completes;
    test with copies slowed down."

    CPU analogue: copies slowed by CHAMELEON_SWAP_TEST_COPY_DELAY. The CPU workers read their
    source through a weak reference, so a source dropped early makes the copy fail loudly; the
    watch below also checks, after every save and every load, that each source whose copy is
    still pending is alive. Budget 0 moves everything; a partial budget leaves copies in flight.
    """
    monkeypatch.setenv("CHAMELEON_SWAP_TEST_COPY_DELAY", "0.002")
    for make, shape in ((ViewsModel, (2, 8, 16)), (FunctionalModel, (2, 7, 16))):
        model = make()
        x = randn(*shape, seed=1)
        peak = natural_peak(model, (x,))
        for budget in (0, peak // 3):
            ref, test = copy.deepcopy(model), copy.deepcopy(model)
            with engine(budget) as eng:
                assert eng._copy.delay_s == 0.002           # the slow copies are really on
                watch = OffloadWatch(eng)
                pack, unpack = eng._ex.pack, eng._ex.unpack
                eng._ex.pack = lambda t: (pack(t), watch.check())[0]
                eng._ex.unpack = lambda h: (unpack(h), watch.check())[0]
                loss = train_step(test, (x,), eng)
                assert eng.last_step.offloaded_bytes > 0
                assert eng.last_step.peak_resident_bytes <= budget
                assert all(t.done() and t.error is None for _, t in watch.entries)
                assert watch.checks > 0
            if budget > 0:
                assert watch.pending_seen > 0               # copies really were in flight
            assert_bitwise(train_step(ref, (x,)), grads(ref), loss, grads(test))


def test_lesson_01_copy_engine_keeps_a_dropped_source_until_its_slow_copy_is_done():
    """LESSONS 1 at the copy-engine level: the caller drops the device tensor at once; the engine
    (deferred free) keeps it until the slow copy completed, and the host gets the right bytes."""
    e = CpuCopyEngine(delay_s=0.05)
    try:
        src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
        expect = src.clone()
        host = torch.zeros_like(src)
        ref = weakref.ref(src)
        ticket = e.offload(src, host, None)
        del src
        gc.collect()
        assert not ticket.done() and ref() is not None
        e.wait_host(ticket)
        assert torch.equal(host, expect)
        e.poll()
        gc.collect()
        assert ref() is None                                 # freed after, not before
    finally:
        e.close()


# =========================================================================== lesson 2
def test_lesson_02_copy_back_waits_for_copy_out_in_the_copy_engine():
    """LESSONS 2: "The copy back to the device was issued before the copy out had finished, so
    backward silently read stale host bytes (Megatron-LM #7398). Order copy-back after copy-out."

    Unit level: only the copy-out worker is slow; a fetch issued right after the offload must
    still read the final bytes, and must not complete before the offload did."""
    e = CpuCopyEngine(delay_s=0.0)
    try:
        e._d2h.delay_s = 0.1
        src = torch.randint(1, 255, (30_000,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(0))
        host = torch.zeros_like(src)                          # "stale" host bytes: zeros
        t_out = e.offload(src, host, None)
        back, t_in = e.fetch(host, t_out)
        e.wait(t_in)
        assert t_out.done()
        assert torch.equal(back, src), "the copy back read the host buffer before the copy out"
    finally:
        e.close()


@pytest.mark.parametrize("fraction", [0.3, 0.0])
def test_lesson_02_engine_orders_every_fetch_after_its_copy_out(fraction):
    """LESSONS 2 at the engine level: with only copies out slowed down, every copy back the
    executor issues names, as ``after``, the ticket of the copy out into the same host buffer,
    and losses and gradients stay bitwise."""
    model = llama()
    ref = copy.deepcopy(model)
    batch = tokens(model, 2, 16, seed=0)
    budget = int(natural_peak(model, batch) * fraction)
    with engine(budget) as eng:
        eng._copy._d2h.delay_s = 0.002                      # copies out late, copies back fast
        out_ticket = {}                                     # host buffer address -> last copy out
        fetches = []
        real_offload, real_fetch = eng._copy.offload, eng._copy.fetch

        def offload(src, dst, ready):
            t = real_offload(src, dst, ready)
            out_ticket[dst.data_ptr()] = t
            return t

        def fetch(src, after):
            fetches.append((after, out_ticket.get(src.data_ptr())))
            return real_fetch(src, after)

        eng._copy.offload, eng._copy.fetch = offload, fetch
        loss = train_step(model, batch, eng)
        assert eng.last_step.offloaded_bytes > 0
    assert fetches, "nothing was copied back: the test did not exercise the path"
    for after, expected in fetches:
        assert expected is not None
        assert after is expected, "a copy back was not ordered after its copy out"
    assert_bitwise(train_step(ref, batch), grads(ref), loss, grads(model))


# =========================================================================== lesson 3
def test_lesson_03_copy_out_is_ordered_after_the_ready_marker_recorded_at_save():
    """LESSONS 3: "The offload stream was not ordered against other streams (tensor-parallel
    collectives), giving a worse loss (torchtune #2683). The copy stream waits on an event
    recorded at save time; test under DDP and FSDP2."

    DDP and FSDP2 (real gloo collectives, slowed copies) are tested in tests/parallel/test_distributed.py;
    the CUDA stream wait itself in the CUDA test file. Here, the CPU part of the contract: each
    storage's "bytes are final" marker is taken once, when it is saved, and the copy out of that
    storage is handed exactly that marker (not None, not another record's, not a fresh one)."""
    model = ViewsModel()
    ref = copy.deepcopy(model)
    x = randn(2, 9, 16, seed=2)
    budget = natural_peak(model, (x,)) // 4
    with engine(budget) as eng:
        markers = []                                         # record_ready() results, in order
        real_ready, real_offload, ex_offload = (eng._copy.record_ready, eng._copy.offload,
                                                eng._ex.offload)
        current = []
        handed = []

        def record_ready():
            real_ready()
            m = object()
            markers.append(m)
            return m

        def offload(src, dst, ready):
            handed.append((current[-1], ready))
            return real_offload(src, dst, None)

        def executor_offload(rec):
            current.append(rec.index)
            ex_offload(rec)

        eng._copy.record_ready, eng._copy.offload, eng._ex.offload = (record_ready, offload,
                                                                      executor_offload)
        loss = train_step(model, (x,), eng)
        assert eng.last_step.offloaded_tensors == len(handed) > 0
    assert len(markers) >= len(handed)                      # one marker per record saved
    for index, ready in handed:
        assert ready is not None, "copy out not ordered after anything"
        assert ready is markers[index], "copy out ordered after another record's save"
    assert len({id(r) for _, r in handed}) == len(handed)    # each marker used once
    assert_bitwise(train_step(ref, (x,)), grads(ref), loss, grads(model))


# =========================================================================== lesson 4
def test_lesson_04_a_tensor_and_its_transpose_from_one_storage_get_the_right_gradients():
    """LESSONS 4: "Dedup keyed on the storage address made a tensor and its transpose share one
    host copy: wrong gradients (ms-swift #10157). Keep size, stride, offset and dtype per view;
    rebuild each view."

    ``h @ h.t()`` (non-square h) and ``q @ k.t()`` (two chunks of one storage, offsets 0 and 8)
    save several views of one storage. At budget 0 each storage is moved once (one record, its
    bytes counted once) and every view is rebuilt with its own geometry: bitwise gradients."""
    w1, w2 = param(5, 16, seed=1), param(16, 3, seed=2)
    x = randn(6, 5, seed=3)

    def fn():
        h = torch.tanh(x @ w1)                               # (6, 16), saved by tanh
        s = h @ h.t()                                        # saves h and h.t(): one storage
        q, k = h.chunk(2, dim=-1)                            # (6, 8) views at offsets 0 and 8
        a = torch.softmax(q @ k.t(), dim=-1)                 # saves q and k.t()
        return (s.sum() * 1e-2) + (a @ (h @ w2)).pow(2).sum()

    ref = run_fn(fn, [w1, w2])
    with engine(0) as eng:
        spy = PackSpy(eng)
        got = run_fn(fn, [w1, w2], eng)
        st = eng.last_step
    assert_bitwise(ref[0], ref[1], got[0], got[1])
    acts = [p for p in spy.packed if not p["param"]]
    distinct = {p["ptr"]: p["nbytes"] for p in acts}
    assert len(acts) > len(distinct)                          # views of one storage were saved
    assert st.saved_bytes == sum(distinct.values())           # ... and recorded once
    assert st.offloaded_tensors == len(distinct)
    geometries = {(p["size"], p["stride"], p["offset"]) for p in acts}
    assert ((16, 6), (1, 16), 0) in geometries                # h.t()
    assert ((8, 6), (1, 16), 8) in geometries                 # k.t(): offset 8


def test_lesson_04_each_view_is_rebuilt_with_its_own_geometry_and_dtype():
    """LESSONS 4, executor level: views of one storage with different size, stride, offset and
    dtype are packed (one record, moved once at budget 0), the device storage is dropped, and
    each unpack rebuilds exactly its own view from the host copy."""
    base = torch.randn(6, 10, generator=torch.Generator().manual_seed(4))
    views = {
        "base": lambda b: b,
        "t": lambda b: b.t(),
        "rows": lambda b: b[2:],
        "cols_t": lambda b: b[:, 3:].t(),
        "strided": lambda b: b.as_strided((3, 3), (1, 10), 7),
        "int32": lambda b: b.view(torch.int32)[1:, ::2],
        "flat": lambda b: b.flatten()[5:17].view(3, 4),
    }
    expect = {k: f(base.clone()) for k, f in views.items()}
    with engine(0) as eng:
        with eng.step():
            handles = {k: eng._ex.pack(f(base)) for k, f in views.items()}
            assert eng._ex.stats.saved_bytes == base.untyped_storage().nbytes()
            assert eng._ex.stats.offloaded_tensors == 1
            storage_ref = weakref.ref(base)
            del base
            gc.collect()
            assert storage_ref() is None                      # only the host copy is left
            for k, h in handles.items():
                got = eng._ex.unpack(h)
                e = expect[k]
                assert got.dtype == e.dtype, k
                assert got.size() == e.size() and got.stride() == e.stride(), k
                assert got.storage_offset() == e.storage_offset(), k
                assert torch.equal(got, e), k
            del handles, h, got
        assert eng.host_bytes_in_use == 0


# =========================================================================== lesson 5
def test_lesson_05_a_new_storage_at_a_freed_address_gets_its_own_record():
    """LESSONS 5: "Addresses are reused within one step once a storage is freed, so a map keyed
    by a bare data pointer returns a stale entry. Identify storages by object."

    Deterministic reuse: two storages over one Python buffer (``torch.frombuffer``), the first
    saved, moved to host (budget 0) and freed before the second is made at the same address. An
    address-keyed map would hand the second the first's host copy; gradients are checked against
    their exact values, and the engine must have made two records."""
    n = 1024
    buf = bytearray(n * 4)
    w1, w2 = param(n, seed=1), param(n, seed=2)
    v1, v2 = randn(n, seed=3), randn(n, seed=4)
    with engine(0) as eng:
        with eng.step():
            a = torch.frombuffer(buf, dtype=torch.float32)
            a.copy_(v1)
            loss1 = (w1 * a).sum()                           # mul saves a
            ptr = a.data_ptr()
            ref = weakref.ref(a)
            del a
            gc.collect()
            assert ref() is None
            b = torch.frombuffer(buf, dtype=torch.float32)   # a new storage, same address
            b.copy_(v2)
            assert b.data_ptr() == ptr
            loss2 = (w2 * b).sum()
            del b
            (loss1 + loss2).backward()
        st = eng.last_step
        assert eng.host_bytes_in_use == 0
    assert st.saved_bytes == 2 * n * 4 and st.offloaded_tensors == 2
    assert torch.equal(w1.grad, v1)
    assert torch.equal(w2.grad, v2)


def test_lesson_05_allocator_address_reuse_within_a_step():
    """LESSONS 5 with the real allocator: several same-sized storages, each saved, moved out and
    freed before the next is allocated (often at the same address). Every step: one record per
    storage and bitwise gradients."""
    n, k = 256, 6
    ws = [param(n, seed=i) for i in range(k)]

    def fn():
        return sum(torch.exp(w).sum() * (i + 1) for i, w in enumerate(ws))

    with engine(0) as eng:
        for _ in range(4):
            ref = run_fn(fn, ws)
            got = run_fn(fn, ws, eng)
            assert_bitwise(ref[0], ref[1], got[0], got[1])
            assert eng.last_step.saved_bytes == k * n * 4
            assert eng.last_step.offloaded_tensors == k


# =========================================================================== lesson 6
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("make", [llama, moe], ids=["llama", "moe"])
def test_lesson_06_unrepresentative_warm_up_then_changing_steps(make, policy):
    """LESSONS 6: "Plans frozen after a warm-up break when the warm-up is not representative: a
    forward-only pass used up Megatron's warm-up (NeMo-RL #2279); SmartSwap: dynamic sequences and
    MoE unsupported, never re-plans. Re-plan on change; guard always underneath."

    For every policy: the first steps are a no-grad forward and a forward without backward (an
    eval step), then training steps whose length (and, for MoE, routing) changes every step. Every
    step holds the budget and every training step is bitwise."""
    model = make()
    ref = copy.deepcopy(model)
    train = [tokens(model, 2, T, seed=10 + i) for i, T in enumerate((8, 24, 12, 24, 16))]
    budget = int(min(natural_peak(model, b) for b in train) * 0.3)
    with engine(budget, policy=policy) as eng:
        with eng.step():
            with torch.no_grad():
                model(*tokens(model, 1, 4, seed=0))
        with eng.step():
            loss = model(*tokens(model, 2, 32, seed=1))      # eval-like: graph, no backward
            del loss
        assert eng.host_bytes_in_use == 0
        for b in train:
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            l_ref = train_step(ref, b)
            loss = train_step(model, b, eng)
            assert_bitwise(l_ref, grads(ref), loss, grads(model))
            assert eng.host_bytes_in_use == 0 and eng.resident_bytes == 0
        assert len(eng.history) == 2 + len(train)
        for s in eng.history:
            assert s.budget_bytes == budget
            assert s.peak_resident_bytes <= budget, s
            assert not s.failed
        assert all(s.offloaded_bytes > 0 for s in eng.history[2:])
        assert len({s.saved_bytes for s in eng.history[2:]}) >= 3   # the steps really differ


# =========================================================================== lesson 7
def _code_tokens(path: Path):
    """NAME tokens and string literals that are not docstrings or comments."""
    toks = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    out = []
    prev = tokenize.NEWLINE
    for tok in toks:
        if tok.type == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT,
                                                     tokenize.DEDENT, tokenize.ENCODING):
            pass                                             # a docstring / bare string statement
        elif tok.type in (tokenize.NAME, tokenize.STRING):
            out.append((tok.type, tok.string, tok.start[0]))
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            prev = tok.type
    return out


def test_lesson_07_no_record_stream_in_the_source():
    """LESSONS 7: "`record_stream` fragments the caching allocator and grows memory without
    bound ... Free through events, in batches." No code line of the library calls it (comments
    and docstrings may mention it), not even through getattr with a string."""
    root = Path(cs.__file__).resolve().parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 5
    offenders = []
    for f in files:
        for kind, text, line in _code_tokens(f):
            if (kind == tokenize.NAME and text == "record_stream") or \
                    (kind == tokenize.STRING and "record_stream" in text):
                offenders.append(f"{f.relative_to(root)}:{line}: {text}")
    assert offenders == []
    # The scanner does see code: it finds names that are there.
    names = {t for f in files for k, t, _ in _code_tokens(f) if k == tokenize.NAME}
    assert {"wait_event", "saved_tensors_hooks", "defer"} <= names


def test_lesson_07_frees_go_through_deferred_completions_and_nothing_accumulates():
    """LESSONS 7, CPU analogue of "free through events, in batches": over several steps the copy
    engine's deferred list is empty at every step end, host memory stays flat after the first
    step (nothing grows without bound), and one poll reaps many finished copies at once."""
    model = llama()
    batch = tokens(model, 2, 16, seed=0)
    budget = int(natural_peak(model, batch) * 0.25)
    with engine(budget) as eng:
        reserved, longest = [], [0]
        poll = eng._copy.poll

        def counting_poll():
            longest[0] = max(longest[0], len(eng._copy._deferred))
            poll()

        eng._copy.poll = counting_poll
        for _ in range(4):
            train_step(model, batch, eng)
            assert len(eng._copy._deferred) == 0
            assert eng.resident_bytes == 0 and eng.host_bytes_in_use == 0
            reserved.append(eng._pool.reserved_bytes)
        assert longest[0] > 1                                # completions were reaped in batches
        assert reserved[1:] == reserved[:1] * 3, reserved


# =========================================================================== lesson 8
@pytest.mark.parametrize("fraction", [0.0, 0.3])
def test_lesson_08_second_identical_step_allocates_no_host_memory(fraction):
    """LESSONS 8: "A fresh pinned host allocation costs milliseconds per tensor. Pool pinned
    buffers by size class and reuse them across steps; bound the pool." Two identical steps: the
    second makes no new host allocation."""
    model = llama()
    batch = tokens(model, 2, 20, seed=0)
    budget = int(natural_peak(model, batch) * fraction)
    with engine(budget) as eng:
        train_step(model, batch, eng)
        first = eng._pool.allocations
        assert first > 0 and eng.last_step.offloaded_tensors > 0
        for _ in range(2):
            train_step(model, batch, eng)
            assert eng._pool.allocations == first
            assert eng.last_step.offloaded_tensors > 0


def test_lesson_08_the_host_pool_is_bounded():
    """LESSONS 8, the bound: with host_memory_limit set to what the largest step needs, steps of
    several lengths all run, and the pool (in use plus cached) never holds more than the limit."""
    model = llama()
    big = tokens(model, 2, 16, seed=0)
    with engine(0) as probe:
        train_step(copy.deepcopy(model), big, probe)
        need = probe.last_step.host_peak_bytes
    with engine(0, host_memory_limit=need) as eng:
        acquire = eng._pool.acquire
        seen = []

        def watched(n):
            buf = acquire(n)
            seen.append(eng._pool.reserved_bytes)
            return buf

        eng._pool.acquire = watched
        for T in (16, 12, 8, 16, 5, 16):
            train_step(model, tokens(model, 2, T, seed=T), eng)
            assert eng._pool.reserved_bytes <= need
        assert seen and max(seen) <= need
        assert eng.last_step.host_peak_bytes <= need


# =========================================================================== lesson 9
class StateOnly(nn.Module):
    """Saves only parameters, views of parameters, a buffer and a view of a buffer."""

    def __init__(self):
        super().__init__()
        self.w1 = param(16, 8, seed=1)
        self.w2 = param(16, 8, seed=2)
        self.register_buffer("scale", randn(8, 8, seed=3))

    def forward(self):
        a = self.w1.t() @ self.w2                            # saves w1.t() (a view) and w2
        b = a * self.scale                                   # saves the buffer
        c = b * self.scale[0]                                # saves a view of the buffer
        return c.sum()


def test_lesson_09_only_parameters_and_buffers_saved_nothing_moves():
    """LESSONS 9: "`save_on_cpu` also moves parameters, which are resident anyway (llama-cookbook
    #115). Skip parameters, buffers and their views." A model whose saved tensors are all
    parameters, buffers or views of them, at budget 0: nothing saved, moved, or pooled; every
    skipped byte counted; gradients bitwise."""
    model = StateOnly()
    ref = copy.deepcopy(model)
    with engine(0) as eng:
        spy = PackSpy(eng)
        loss = train_step(model, (), eng, loss_fn=lambda m, b: m())
        s = eng.last_step
        assert eng._pool.allocations == 0
    assert len(spy.packed) == 4
    assert s.saved_bytes == 0 and s.offloaded_bytes == 0 and s.offloaded_tensors == 0
    assert s.peak_resident_bytes == 0 and s.host_peak_bytes == 0
    assert s.fetched_bytes == s.prefetched_bytes == 0
    assert s.skipped_bytes == sum(p["nbytes"] for p in spy.packed) == (16 * 8 * 2 + 8 * 8 * 2) * 4
    assert_bitwise(train_step(ref, (), loss_fn=lambda m, b: m()), grads(ref), loss, grads(model))


def test_lesson_09_parameters_are_never_handed_to_the_copy_engine():
    """LESSONS 9 in a real model (Llama: linear weights saved as transposed views, RMSNorm
    weights, RoPE buffers): at budget 0 no parameter or buffer storage ever reaches the copy
    engine, the bytes saved and moved are exactly the activations' (state saves are counted
    as skipped instead), and gradients are bitwise."""
    model = llama()
    ref = copy.deepcopy(model)
    batch = tokens(model, 2, 12, seed=0)
    state_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()} | \
                 {b.untyped_storage().data_ptr() for b in model.buffers()}
    with engine(0) as eng:
        spy = PackSpy(eng)
        moved = []
        real = eng._copy.offload

        def offload(src, dst, ready):
            moved.append(src.untyped_storage().data_ptr())
            return real(src, dst, ready)

        eng._copy.offload = offload
        loss = train_step(model, batch, eng)
        s = eng.last_step
    assert moved and not (set(moved) & state_ptrs)
    state = [p for p in spy.packed if p["ptr"] in state_ptrs]
    acts = {p["ptr"]: p["nbytes"] for p in spy.packed if p["ptr"] not in state_ptrs}
    assert state and acts
    assert s.skipped_bytes == sum(p["nbytes"] for p in state) > 0
    assert s.saved_bytes == sum(acts.values())
    assert s.offloaded_bytes == s.saved_bytes                 # budget 0: every activation, only
    assert_bitwise(train_step(ref, batch), grads(ref), loss, grads(model))


# =========================================================================== lesson 10
class Stack(nn.Module):
    def __init__(self, depth=8, dim=32):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
                                      for _ in range(depth)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        return self.head(self.blocks(x)).pow(2).mean()


def test_lesson_10_the_guard_keeps_the_tail_resident():
    """LESSONS 10: "Offloading the output head and last layers slows training: backward needs them
    first. Keep what cannot be hidden resident."

    What the guard promises (policy/guard.py): when over the budget it copies out the tensors
    saved *earliest*, keeping room for one more of the largest size. So at the end of forward the
    moved records are a prefix of the save order, the records still resident are the suffix (the
    head's and last layers' tensors) filling the budget up to that headroom, and backward's
    first loads are served from the device without any copy back."""
    model = Stack()
    ref = copy.deepcopy(model)
    x = randn(8, 32, seed=1)
    layer_bytes = 8 * 32 * 4
    budget = 4 * layer_bytes                                  # room for the last few layers
    with engine(budget, policy="guard") as eng:
        moved = []
        first_loads = []
        ex_offload, ex_unpack = eng._ex.offload, eng._ex.unpack

        def offload(rec):
            moved.append(rec.index)
            ex_offload(rec)

        def unpack(h):
            if h.rec is not None and len(first_loads) < 3:       # (parameters: no record)
                first_loads.append((h.rec.index, h.rec.state, h.rec.index in moved))
            return ex_unpack(h)

        eng._ex.offload, eng._ex.unpack = offload, unpack
        with eng.step():
            loss = model(x)
            eng._copy.synchronize()
            eng._copy.poll()
            recs = sorted(eng._ex.live, key=lambda r: r.index)
            n = len(recs)
            assert n == 8 + 2                                  # input, 8 tanh outputs, head out
            assert sorted(moved) == list(range(len(moved))), moved   # a prefix of save order
            kept = [r for r in recs if r.index not in moved]
            assert kept and all(r.state == RESIDENT for r in kept)
            assert [r.index for r in kept] == list(range(len(moved), n))  # the suffix
            kept_bytes = sum(r.nbytes for r in kept)
            largest = max(r.nbytes for r in recs)
            assert kept_bytes <= budget
            assert kept_bytes >= budget - 2 * largest          # the budget is used, not wasted
            assert recs[-1].index not in moved                 # the head's saved output
            assert recs[-2].index not in moved                 # the last layer's activation
            assert all(r.state == HOST for r in recs if r.index in moved)
            loss.backward()
        s = eng.last_step
    assert s.peak_resident_bytes <= budget
    assert first_loads[0][0] == n - 1                          # backward starts at the tail...
    assert all(state == RESIDENT and not was_moved for _, state, was_moved in first_loads[:2])
    assert_bitwise(train_step(ref, (x,)), grads(ref), loss.detach(), grads(model))


# =========================================================================== lesson 11
INPLACE = "modified by an inplace operation"


def _budget_for(where, nbytes):
    # in_flight: room for one tensor, but the guard keeps headroom, so it starts a copy out at once.
    return {"resident": None, "offloaded": 0, "in_flight": nbytes + nbytes // 2}[where]


@pytest.mark.parametrize("how", ["tensor", "view"])
@pytest.mark.parametrize("where", ["resident", "offloaded", "in_flight"])
def test_lesson_11_inplace_after_save_raises_autograd_error(where, how):
    """LESSONS 11: "With saved-tensor hooks autograd no longer checks in-place modification of
    saved tensors: a hook that copies returns a different gradient instead of the error. Record
    the version at save and check it at load."

    The saved tensor (or a view of it) is modified in place after save while it is resident, after
    it was moved to host, and while its copy out is in flight (slowed down): backward raises
    autograd's error, as without the engine, and the failed step leaks nothing."""
    w = param(4096, seed=5)
    budget = _budget_for(where, w.numel() * 4)

    def body():
        y = torch.exp(w)                                     # exp saves its output
        loss = (y * 2).sum()
        return y, loss

    def modify(y):
        (y if how == "tensor" else y[10:20]).add_(1.0)

    y, loss = body()                                         # without the engine: the error
    modify(y)
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()
    with engine(budget) as eng:
        if where == "in_flight":
            eng._copy._d2h.delay_s = 0.2
        with pytest.raises(RuntimeError, match=INPLACE):
            with eng.step():
                y, loss = body()
                states = [r.state for r in eng._ex.live]
                expected = {"resident": RESIDENT, "offloaded": HOST, "in_flight": OFFLOADING}[where]
                assert states == [expected], states
                modify(y)
                loss.backward()
        assert eng.last_step.failed
        del y, loss
        gc.collect()
        assert eng.host_bytes_in_use == 0 and eng.resident_bytes == 0


def test_lesson_11_inplace_on_the_base_of_a_saved_view_before_its_copy_out():
    """LESSONS 11, the case the check at copy-out time exists for: mm saves the temporary view
    ``x.t()`` (nobody else holds it); the user changes ``x`` in place while the record is still
    resident; a later save pushes the record out. The copy out sees the changed version, and
    backward raises autograd's error instead of using the changed bytes."""
    w1, w2 = param(64, 512, seed=6), param(64, 512, seed=8)
    x, z = randn(32, 512, seed=7), randn(32, 512, seed=9)
    nbytes = x.numel() * 4
    budget = nbytes * 5 // 2                     # the first record stays, the second pushes it out
    with engine(budget) as eng:
        moved = []
        ex_offload = eng._ex.offload
        eng._ex.offload = lambda rec: (moved.append(rec.index), ex_offload(rec))
        with pytest.raises(RuntimeError, match=INPLACE):
            with eng.step():
                xe = x.clone()
                a = (w1 @ xe.t()).sum()                      # saves xe.t(): record 0, resident
                assert moved == []
                xe.add_(1.0)
                b = (w2 @ z.clone().t()).sum()               # record 1: record 0 goes out
                assert moved == [0]
                (a + b).backward()
        del a, b, xe
        gc.collect()
        assert eng.host_bytes_in_use == 0 and eng.resident_bytes == 0


@pytest.mark.parametrize("where", ["resident", "offloaded", "in_flight"])
def test_lesson_11_inplace_on_the_base_of_a_saved_temporary_view_raises(where):
    """LESSONS 11 with the saved tensor a temporary view: mm saves ``x.t()``, which nobody but
    autograd holds; the user then changes ``x`` in place. Without the engine autograd raises (the
    view shares x's version counter); with it, the same error must come."""
    w = param(64, 512, seed=6)
    x = randn(32, 512, seed=7)
    budget = _budget_for(where, x.numel() * 4)

    xr = x.clone()
    loss = (w @ xr.t()).sum()                                # mm saves xr.t() (a dead view)
    xr.add_(1.0)
    try:
        loss.backward()
        raised = False
    except RuntimeError as e:
        raised = INPLACE in str(e)
    assert raised, "the reference (no engine) should raise autograd's error"
    with engine(budget) as eng:
        if where == "in_flight":
            eng._copy._d2h.delay_s = 0.2
        with pytest.raises(RuntimeError, match=INPLACE):
            with eng.step():
                xe = x.clone()
                loss = (w @ xe.t()).sum()
                states = [r.state for r in eng._ex.live]
                expected = {"resident": RESIDENT, "offloaded": HOST, "in_flight": OFFLOADING}[where]
                assert states == [expected], states
                xe.add_(1.0)
                loss.backward()
        assert eng.last_step.failed
        del loss, xe
        gc.collect()
        assert eng.host_bytes_in_use == 0 and eng.resident_bytes == 0


# =========================================================================== lesson 12
def _noncontiguous_cases():
    w1 = param(12, 16, seed=1)
    w2 = param(5, 6, seed=2)
    w3 = param(6, 16, seed=3)
    w4 = param(3, 4, seed=4)
    conv1 = param(8, 3, 3, 3, seed=5)
    conv2 = param(4, 8, 3, 3, seed=6)
    wc = param(16, seed=7, dtype=torch.complex64)
    x = randn(6, 12, seed=8)
    img = randn(2, 3, 10, 10, seed=9).to(memory_format=torch.channels_last)
    z = torch.randn(16, dtype=torch.complex64, generator=torch.Generator().manual_seed(10))

    def transpose():
        h = torch.tanh(x @ w1)                               # (6, 16)
        return (w2 @ h[:5].t()[:6]).pow(2).sum()            # mm saves a transposed slice

    def expand():
        h = torch.tanh(x @ w1)
        col = h[:, :1].expand(6, 16)                         # stride 0 along dim 1
        return (w3 * col).pow(2).sum()                       # mul saves the expanded view

    def as_strided():
        h = torch.tanh(x @ w1).flatten()
        v = h.as_strided((3, 4), (5, 1), 7)                   # offset 7, overlapping rows
        return (w4 * v).pow(2).sum()

    def channels_last():
        h = F.conv2d(img, conv1, padding=1)                  # saves a channels_last input
        h = torch.tanh(h)                                    # channels_last activation
        return F.conv2d(h, conv2).pow(2).mean()

    def conj_neg():
        return (wc * z.conj()).abs().sum() + (wc.real * z.conj().imag).pow(2).sum()

    return {
        "transpose": (transpose, [w1, w2], lambda p: not p["contiguous"] and p["stride"][0] == 1),
        "expand": (expand, [w1, w3], lambda p: 0 in p["stride"]),
        "as_strided": (as_strided, [w1, w4], lambda p: p["offset"] == 7 and p["stride"] == (5, 1)),
        "channels_last": (channels_last, [conv1, conv2],
                          lambda p: p["channels_last"] and not p["contiguous"] and not p["param"]),
        "conj_neg": (conj_neg, [wc], lambda p: p["conj"] or p["neg"]),
    }


@pytest.mark.parametrize("case", list(_noncontiguous_cases()))
def test_lesson_12_noncontiguous_saved_tensors_bitwise(case):
    """LESSONS 12: "Non-contiguous tensors are skipped with a warning by TransformerEngine: they
    are common (transposes saved by matmul). Handle them." Transposes, expands (stride 0),
    as_strided with an offset, channels_last conv inputs, conj and neg views: each saved, moved
    at budget 0 (not skipped, no warning) and rebuilt; gradients bitwise."""
    fn, params, is_case = _noncontiguous_cases()[case]
    ref = run_fn(fn, params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # no "skipped" warning either
        with engine(0) as eng:
            spy = PackSpy(eng)
            got = run_fn(fn, params, eng)
            s = eng.last_step
    assert_bitwise(ref[0], ref[1], got[0], got[1])
    hits = [p for p in spy.packed if is_case(p) and not p["param"]]
    assert hits, f"no {case} tensor was saved: the case does not test what it says"
    assert s.offloaded_bytes == s.saved_bytes > 0             # nothing skipped for its layout
    assert s.saved_bytes >= sum({p["ptr"]: p["nbytes"] for p in hits}.values())


# =========================================================================== lesson 13
def test_lesson_13_host_memory_limit_is_a_clear_error_and_the_engine_recovers():
    """LESSONS 13: "Pinned host memory is finite ... Bound host use with a clear error." A step
    that needs more host memory than host_memory_limit raises HostMemoryError naming the option
    and the limit. The part of the graph built before the error is still referenced, yet nothing
    stays held (the failed step released its records, and backward through them fails loudly);
    the same engine then runs a step that fits, bitwise."""
    w = param(64, 64, seed=1)
    limit = 16 * 2**10
    with engine(0, host_memory_limit=limit) as eng:
        assert eng.config.host_memory_limit_bytes == limit
        x = randn(32, 64, seed=2)                            # 8 KiB per activation
        with pytest.raises(cs.HostMemoryError, match="host_memory_limit") as exc:
            with eng.step():
                h = torch.tanh(x @ w)                        # x and h: 16 KiB on host
                assert eng.host_bytes_in_use == limit
                torch.tanh(h @ w)                            # 8 KiB more: over the limit
        assert isinstance(exc.value, RuntimeError)
        assert "16.00 KiB" in str(exc.value)
        assert eng.last_step.failed
        assert h.grad_fn is not None                         # the graph is still referenced
        assert eng.host_bytes_in_use == 0 and eng.resident_bytes == 0
        assert eng._pool.reserved_bytes <= limit
        with pytest.raises(RuntimeError, match="released"):
            h.sum().backward()
        del h, exc
        x4 = randn(4, 64, seed=3)                            # 1 KiB per activation: fits

        def fn():
            return torch.tanh(torch.tanh(x4 @ w) @ w).pow(2).sum()

        ref = run_fn(fn, [w])
        got = run_fn(fn, [w], eng)
        assert not eng.last_step.failed and eng.last_step.offloaded_bytes > 0
        assert eng.host_bytes_in_use == 0
    assert_bitwise(ref[0], ref[1], got[0], got[1])


def test_lesson_13_default_host_limit_is_bounded_and_bandwidth_is_reported():
    """LESSONS 13, the other half: the default host limit is a bound below the machine's memory,
    and the copy bandwidth is measured and reported (CPU: a memcpy, small size here)."""
    from chameleon_swap.config import total_host_memory
    with engine(0) as eng:
        limit = eng.config.host_memory_limit_bytes
    total = total_host_memory()
    assert 0 < limit and (total is None or limit < total)
    r = measure_bandwidth("cpu", nbytes=256 * 2**10, repeats=2)
    assert r.h2d_bytes_per_s > 0 and r.d2h_bytes_per_s > 0 and r.method == "cpu-memcpy"


# =========================================================================== lesson 14
@pytest.mark.parametrize("first_call", ["in_step", "before"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_lesson_14_torch_compile_inside_a_step_is_bitwise(backend, first_call):
    """LESSONS 14: "Saved-tensor hooks under `torch.compile` were silently wrong in older PyTorch
    (pytorch #116221). Support compiled regions or refuse them with a clear error; never run them
    silently wrong."

    What torch 2.13 does (found by this test): a module compiled with backend "eager" or
    "aot_eager" runs inside ``eng.step()`` with the engine's hooks applied to the compiled graph's
    saved tensors, whether it was first called (traced) inside the step or before any step. So
    the check is: saved tensors are really moved (budget 0), losses and gradients bitwise over
    two steps. A regression would show as a failure here, never as a silent pass."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh())
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    batches = [randn(8, 16, seed=i) for i in range(2)]
    try:
        with warnings.catch_warnings():
            # torch warns that global module hooks (the engine's) also fire for the wrapper.
            warnings.filterwarnings("ignore", message=".*global hooks on modules.*")
            if first_call == "before":
                compiled(batches[0]).sum().backward()       # traced with no hooks installed
            with engine(0) as eng:
                for x in batches:
                    model.zero_grad(set_to_none=True)
                    ref.zero_grad(set_to_none=True)
                    l_ref = ref(x).pow(2).sum()
                    l_ref.backward()
                    with eng.step():
                        loss = compiled(x).pow(2).sum()
                        loss.backward()
                    assert_bitwise(l_ref.detach(), grads(ref), loss.detach(), grads(model))
                    s = eng.last_step
                    # The compiled region's own saved activations moved too (not only pow's).
                    assert s.offloaded_tensors >= 3 and s.peak_resident_bytes == 0, s
                    # A compiled graph may keep a used saved tensor until the graph itself goes
                    # (the promise is 0 host bytes once graphs are gone).
                    del loss
                    assert eng.host_bytes_in_use == 0
    finally:
        torch._dynamo.reset()

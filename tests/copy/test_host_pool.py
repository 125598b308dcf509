"""The host arena (``copy/host_pool.py``) on CPU: buffers are aligned, non-overlapping ranges of a
few slabs; released ranges coalesce and are reused; the arena grows geometrically and never past
``host_memory_limit``; ``host_memory_reserve`` is allocated on a background thread that an early
``acquire`` waits for; ``close()`` hands everything back. Through the engine: a warm arena allocates
nothing on later steps of any smaller or mixed length, gradients bitwise."""
from __future__ import annotations

import copy
import threading
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import chameleon_swap as cs
from chameleon_swap.copy import host_pool
from chameleon_swap.copy.host_pool import (ALIGN, HEADROOM_FRACTION, MIN_SLAB_BYTES, HostBuffer,
                                           HostMemoryError, HostPool, align_up)
from chameleon_swap.workloads import Llama, LlamaConfig

from _helpers import assert_bitwise, grads, natural_peak, train_step

KiB, MiB = 2**10, 2**20
TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")   # see conftest.py


def ranges(bufs) -> dict:
    """slab id -> sorted (start, end) of the buffers in ``bufs``."""
    out: dict = {}
    for b in bufs:
        out.setdefault(id(b.slab), []).append((b.offset, b.offset + b.capacity))
    return {k: sorted(v) for k, v in out.items()}


def assert_disjoint(bufs) -> None:
    for spans in ranges(bufs).values():
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start, spans


def assert_all_free(pool: HostPool) -> None:
    """Every slab is back to one free range covering all of it (coalescing worked)."""
    sizes = pool.slab_sizes
    assert pool.free_ranges() == [(i, 0, n) for i, n in enumerate(sizes)]
    assert pool.in_use_bytes == 0 and pool.cached_bytes == pool.reserved_bytes == sum(sizes)


# =========================================================================== sub-allocation
@pytest.mark.parametrize("nbytes,expected", [(0, ALIGN), (1, ALIGN), (ALIGN, ALIGN),
                                             (ALIGN + 1, 2 * ALIGN), (5000, 8192)])
def test_align_up_gives_whole_pages(nbytes, expected):
    assert align_up(nbytes) == expected


def test_buffers_are_aligned_disjoint_ranges_of_one_slab():
    pool = HostPool(64 * MiB, pin=False)
    sizes = [5000, 1, 3 * MiB // 7, 4096, 70_000]
    bufs = [pool.acquire(n) for n in sizes]
    assert pool.allocations == 1 and pool.slab_sizes == [MIN_SLAB_BYTES]
    assert len({id(b.slab) for b in bufs}) == 1
    slab = bufs[0].slab.tensor
    for b, n in zip(bufs, sizes):
        assert isinstance(b, HostBuffer) and b.capacity == align_up(n)
        assert b.tensor.dtype == torch.uint8 and b.tensor.device.type == "cpu"
        assert not b.tensor.is_pinned()
        assert b.tensor.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr()
        assert b.tensor.data_ptr() % ALIGN == 0                      # page-aligned start
        v = b.view(n)
        assert v.numel() == n and v.data_ptr() == b.tensor.data_ptr()
    assert_disjoint(bufs)
    # Writes through one buffer never show in another.
    for i, b in enumerate(bufs):
        b.tensor.fill_(i)
    for i, b in enumerate(bufs):
        assert bool((b.tensor == i).all())
    assert pool.in_use_bytes == sum(align_up(n) for n in sizes)


def test_a_view_past_its_buffer_is_refused_by_name():
    """``view(nbytes)`` slices the slab itself (no tensor kept per buffer): a view longer than the
    buffer would run into its neighbour's range, so it is refused, naming the argument."""
    pool = HostPool(64 * MiB, pin=False)
    a, b = pool.acquire(5000), pool.acquire(5000)
    assert a.view(a.capacity).numel() == a.capacity and a.view(0).numel() == 0
    with pytest.raises(ValueError, match=r"nbytes must be within this buffer's capacity 8192"):
        a.view(a.capacity + 1)
    with pytest.raises(ValueError, match="nbytes"):
        a.view(-1)
    b.view(b.capacity).fill_(2)
    a.view(a.capacity).fill_(1)
    assert bool((b.tensor == 2).all()) and bool((a.tensor == 1).all())


def test_released_ranges_coalesce_and_are_reused_without_allocating():
    pool = HostPool(64 * MiB, pin=False)
    a, b, c = pool.acquire(8 * KiB), pool.acquire(8 * KiB), pool.acquire(8 * KiB)
    pool.release(a)
    pool.release(c)                       # two holes; c's merges with the free tail
    assert pool.free_ranges() == [(0, 0, 8 * KiB), (0, 16 * KiB, MIN_SLAB_BYTES - 16 * KiB)]
    pool.release(b)                       # bridges both neighbours: one range again
    assert_all_free(pool)
    d = pool.acquire(24 * KiB)            # fits where the three were: first fit, offset 0
    assert d.offset == 0 and pool.allocations == 1
    with pytest.raises(RuntimeError, match="already released"):
        pool.release(a)                   # a second release would corrupt the free list
    pool.release(d)
    assert_all_free(pool)


def test_the_arena_grows_by_doubling_slabs_and_reuses_them_all():
    pool = HostPool(1 << 40, pin=False)
    held = [pool.acquire(MIN_SLAB_BYTES) for _ in range(4)]
    # 2 MiB, then a slab as large as the arena: 2, 4, 8 MiB in all, never one per request.
    assert pool.slab_sizes == [MIN_SLAB_BYTES, MIN_SLAB_BYTES, 2 * MIN_SLAB_BYTES]
    big = pool.acquire(20 * MiB)          # larger than the arena: the slab is the next power of two
    assert pool.slab_sizes[-1] == 32 * MiB and pool.allocations == 4
    assert pool.allocated_bytes == pool.reserved_bytes == sum(pool.slab_sizes)
    for b in held + [big]:
        pool.release(b)
    assert_all_free(pool)
    before = pool.allocations
    again = [pool.acquire(n) for n in (20 * MiB, MIN_SLAB_BYTES, 3 * MiB, 5000)]
    assert pool.allocations == before    # the warm arena serves smaller and mixed sizes
    assert_disjoint(again)


def test_in_use_and_peak_stats():
    pool = HostPool(1 << 30, pin=False)
    a, b = pool.acquire(4096), pool.acquire(10_000)
    assert pool.in_use_bytes == pool.peak_in_use_bytes == 4096 + 12 * KiB
    pool.release(a)
    assert pool.in_use_bytes == 12 * KiB
    assert pool.cached_bytes == pool.reserved_bytes - 12 * KiB
    assert pool.peak_in_use_bytes == 16 * KiB          # a peak does not go down
    pool.release(b)
    pool.acquire(4096)
    assert pool.peak_in_use_bytes == 16 * KiB


# =========================================================================== the limit
def test_limit_raises_host_memory_error_naming_host_memory_limit():
    pool = HostPool(3 * 4096, pin=False)
    held = [pool.acquire(4096) for _ in range(3)]
    assert pool.slab_sizes == [3 * 4096]               # the first slab is capped by the limit
    with pytest.raises(HostMemoryError, match="host_memory_limit") as exc:
        pool.acquire(1)
    msg = str(exc.value)
    assert "12.00 KiB" in msg                          # the limit, in readable units
    assert "Raise host_memory_limit" in msg            # and what to do about it
    assert isinstance(exc.value, RuntimeError)
    assert cs.HostMemoryError is HostMemoryError       # exported at the top level
    assert pool.in_use_bytes == 3 * 4096 and pool.allocations == 1   # a refusal changes nothing
    pool.release(held.pop())
    pool.acquire(1)                                    # room again, in the same slab
    assert pool.allocations == 1


def test_a_single_request_over_the_limit_raises_even_when_empty():
    pool = HostPool(10 * KiB, pin=False)
    with pytest.raises(HostMemoryError, match="host_memory_limit"):
        pool.acquire(11 * KiB)
    assert pool.in_use_bytes == 0 and pool.reserved_bytes == 0 and pool.allocations == 0


def test_free_slabs_are_handed_back_to_make_room_for_a_larger_one():
    pool = HostPool(16 * KiB, pin=False, reserve_bytes=8 * KiB)
    assert pool.wait_reserve() and pool.slab_sizes == [8 * KiB]
    pool.release(pool.acquire(8 * KiB))
    b16 = pool.acquire(16 * KiB)                       # only fits once the 8 KiB slab is gone
    assert b16.capacity == 16 * KiB and pool.slab_sizes == [16 * KiB]
    assert pool.reserved_bytes == 16 * KiB


def test_fragmentation_at_the_limit_is_a_clear_error():
    pool = HostPool(16 * KiB, pin=False)
    bufs = [pool.acquire(4 * KiB) for _ in range(4)]
    pool.release(bufs[0])
    pool.release(bufs[2])                              # 8 KiB free, as two 4 KiB holes
    with pytest.raises(HostMemoryError, match="host_memory_limit") as exc:
        pool.acquire(8 * KiB)
    assert "too small" in str(exc.value) and "host_memory_reserve" in str(exc.value)
    assert pool.in_use_bytes == 8 * KiB and pool.reserved_bytes == 16 * KiB


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 600 * KiB), st.integers(0, 10**6)),
                    min_size=1, max_size=120),
       limit_kib=st.sampled_from([512, 4096, 1 << 20]))
def test_random_acquire_and_release_never_overlap_and_coalesce_back(ops, limit_kib):
    limit = limit_kib * KiB
    pool = HostPool(limit, pin=False)
    held: list[HostBuffer] = []
    for release, n, pick in ops:
        if release and held:
            pool.release(held.pop(pick % len(held)))
        else:
            try:
                held.append(pool.acquire(n))
            except HostMemoryError as e:
                # Refused only when the limit is the reason: no room, or no room for a new slab.
                assert pool.in_use_bytes + align_up(n) > limit or "too small" in str(e)
                assert pool.reserved_bytes + align_up(n) > limit
        assert_disjoint(held)
        assert pool.in_use_bytes == sum(b.capacity for b in held)
        assert pool.reserved_bytes <= limit and pool.peak_in_use_bytes <= limit
        assert pool.reserved_bytes == sum(pool.slab_sizes)
    for b in held:
        pool.release(b)
    assert_all_free(pool)


def test_pool_is_consistent_under_concurrent_acquire_and_release():
    pool = HostPool(64 * MiB, pin=False)
    errors = []

    def work(seed):
        try:
            g = torch.Generator().manual_seed(seed)
            for _ in range(300):
                n = int(torch.randint(1, 64 * KiB, (), generator=g))
                pool.release(pool.acquire(n))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert_all_free(pool)


# =========================================================================== reserve and close
def test_reserve_is_one_slab_allocated_in_the_background():
    pool = HostPool(64 * MiB, pin=False, reserve_bytes=8 * MiB)
    assert pool.wait_reserve(timeout=60)
    assert pool.slab_sizes == [8 * MiB] and pool.allocations == 1
    bufs = [pool.acquire(n) for n in (3 * MiB, 2 * MiB, 5000, 2 * MiB)]
    assert pool.allocations == 1                       # all of it served from the reserve
    assert_disjoint(bufs)
    pool.close()


def test_reserve_over_the_limit_is_refused():
    with pytest.raises(ValueError, match="host_memory_reserve.*host_memory_limit"):
        HostPool(8 * MiB, pin=False, reserve_bytes=9 * MiB)


def test_an_acquire_before_the_reserve_is_ready_waits_for_it(monkeypatch):
    gate, started = threading.Event(), threading.Event()
    real = host_pool._Slab

    def slow_slab(size, pin):
        started.set()
        assert gate.wait(30)
        return real(size, pin)

    monkeypatch.setattr(host_pool, "_Slab", slow_slab)
    pool = HostPool(64 * MiB, pin=False, reserve_bytes=8 * MiB)
    assert started.wait(30)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(MiB)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and got == [] and pool.allocations == 0   # waiting, nothing beside it
    assert pool.wait_reserve(timeout=0) is False
    gate.set()
    t.join(30)
    assert len(got) == 1 and pool.allocations == 1 and pool.slab_sizes == [8 * MiB]
    pool.close()


def test_a_failed_reserve_is_reported_naming_host_memory_reserve(monkeypatch):
    def no_memory(size, pin):
        raise RuntimeError("simulated: cannot pin")

    monkeypatch.setattr(host_pool, "_Slab", no_memory)
    pool = HostPool(64 * MiB, pin=False, reserve_bytes=8 * MiB)
    for call in (pool.wait_reserve, lambda: pool.acquire(1)):
        with pytest.raises(HostMemoryError, match="host_memory_reserve.*simulated: cannot pin"):
            call()
    assert pool.reserved_bytes == 0
    pool.close()


def test_close_hands_back_every_slab_even_those_still_in_use():
    pool = HostPool(1 << 30, pin=False, reserve_bytes=4 * MiB)
    a = pool.acquire(3 * MiB)
    b = pool.acquire(5 * MiB)                          # a second slab
    pool.release(a)
    pool.close()
    assert pool.reserved_bytes == pool.slab_sizes[0] == b.slab.size  # only b's slab is left
    pool.release(b)                                    # its last buffer returns: dropped too
    assert pool.reserved_bytes == 0 and pool.slab_sizes == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(1)


def test_close_waits_for_a_reserve_still_being_allocated():
    pool = HostPool(1 << 30, pin=False, reserve_bytes=16 * MiB)
    pool.close()
    assert pool.reserved_bytes == 0 and not pool._reserver.is_alive()


def test_allocating_host_is_set_only_while_the_arena_allocates(monkeypatch):
    seen = []
    real_empty = torch.empty

    def spy(*args, **kwargs):
        seen.append(host_pool.allocating_host())
        return real_empty(*args, **kwargs)
    pool = HostPool(2**30, pin=False)
    monkeypatch.setattr(host_pool.torch, "empty", spy)
    buf = pool.acquire(5000)          # the first slab: allocated under the flag
    pool.release(buf)
    pool.acquire(70_000)              # a range of it: no allocation at all
    assert seen and all(seen) and pool.allocations == 1
    assert host_pool.allocating_host() is False


# =========================================================================== through the engine
def llama():
    torch.manual_seed(0)
    return Llama(LlamaConfig(**TINY))


def tokens(model, B, T, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(model.config.vocab_size, (B, T + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def test_a_warm_arena_allocates_nothing_for_smaller_and_mixed_lengths():
    """One step at the longest length warms the arena; every later step, of any length up to
    it, allocates no host memory, and every loss and gradient is bitwise the plain run's."""
    model = llama()
    lengths = [32, 8, 20, 13, 32, 5, 27, 16]
    batches = [tokens(model, 2, T, seed=i) for i, T in enumerate(lengths)]
    budget = int(natural_peak(model, batches[1]) * 0.3)   # forces offloads at every length
    ref, test = copy.deepcopy(model), copy.deepcopy(model)
    with cs.Chameleon(budget, device="cpu", min_tensor_bytes=0, policy="guard") as eng:
        for i, b in enumerate(batches):
            ref.zero_grad(set_to_none=True)
            test.zero_grad(set_to_none=True)
            loss_ref = train_step(ref, b)
            loss = train_step(test, b, eng)
            assert_bitwise(loss_ref, grads(ref), loss, grads(test))
            s = eng.last_step
            assert s.offloaded_tensors > 0 and eng.host_bytes_in_use == 0
            if i == 0:
                # Copy-outs the budget did not need yet were put off while the background
                # thread grew the arena: what it grew before a copy-out waited for it belongs
                # to no step (host_deferred_moves), the rest to this one.
                assert 0 < eng.host_bytes_reserved and \
                    s.host_allocated_bytes <= eng.host_bytes_reserved
            else:
                assert s.host_allocated_bytes == 0, (i, lengths[i], s)
        assert eng.host_bytes_reserved > 0
    assert eng.host_bytes_reserved == 0                # close() handed it all back


def test_host_memory_reserve_serves_the_first_step():
    model = llama()
    batch = tokens(model, 2, 16, seed=0)
    with cs.Chameleon(0, device="cpu", min_tensor_bytes=0, host_memory_reserve="8MiB") as eng:
        assert eng._pool.wait_reserve(timeout=60)
        assert eng.host_bytes_reserved == 8 * MiB and eng.host_bytes_in_use == 0
        train_step(model, batch, eng)
        s = eng.last_step
        assert 0 < s.host_peak_bytes < 8 * MiB and s.offloaded_tensors > 0
        assert s.host_allocated_bytes == 0 and eng.host_bytes_reserved == 8 * MiB
    assert eng.host_bytes_reserved == 0


def test_host_memory_reserve_over_the_limit_names_both():
    with pytest.raises(ValueError) as exc:
        cs.Chameleon(device="cpu", host_memory_limit="1MiB", host_memory_reserve="2MiB")
    assert "host_memory_reserve" in str(exc.value) and "host_memory_limit" in str(exc.value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_slabs_are_pinned_and_allocations_stay_flat_after_warm_up():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**TINY)).cuda()
    lengths = [32, 8, 20, 32, 5, 27]
    with cs.Chameleon(0, device="cuda", min_tensor_bytes=0) as eng:
        pool = eng._pool
        for i, T in enumerate(lengths):
            x, y = tokens(model, 2, T, seed=i)
            train_step(model, (x.cuda(), y.cuda()), eng)
            model.zero_grad(set_to_none=True)
            if i == 0:
                warm = pool.allocations
                assert warm > 0
                assert all(slab.tensor.is_pinned() for slab in pool._slabs)
            else:
                assert pool.allocations == warm and eng.last_step.host_allocated_bytes == 0
    assert eng.host_bytes_reserved == 0


def test_free_slabs_are_trimmed_to_what_recent_steps_used():
    from chameleon_swap.copy.host_pool import TRIM_WINDOW
    pool = HostPool(2**30, pin=False)
    big = [pool.acquire(2**22) for _ in range(4)]         # one large step
    for b in big:
        pool.release(b)
    pool.end_step()
    grown = pool.reserved_bytes
    assert grown >= 2**24
    for _ in range(TRIM_WINDOW):                           # small steps from now on
        b = pool.acquire(2**16)
        pool.release(b)
        pool.end_step()
    assert pool.reserved_bytes < grown                     # the large step's slabs went back
    assert pool.reserved_bytes >= 2**16
    small = pool.reserved_bytes
    for _ in range(3):                                     # steady: nothing more is allocated
        before = pool.allocations
        b = pool.acquire(2**16)
        pool.release(b)
        pool.end_step()
        assert pool.allocations == before and pool.reserved_bytes == small


def test_settle_returns_buffers_no_record_holds_and_rebuilds_free_ranges():
    pool = HostPool(2**26, pin=False)
    a, b, c = (pool.acquire(10_000) for _ in range(3))
    b.slab._free.clear()                                   # as if a release was cut short
    b.slab._starts.clear()
    pool.settle([a])                                       # only a is still held
    assert pool.in_use_bytes == a.capacity
    assert not b.live and not c.live
    pool.release(a)
    assert pool.in_use_bytes == 0
    assert pool.free_ranges() == [(0, 0, pool.slab_sizes[0])]


# =========================================================================== growing ahead
def test_the_background_thread_grows_in_bounded_chunks_and_a_ready_slab_costs_no_wait():
    """Issue 19, item 1: with ``ahead=True`` the arena keeps free room ahead of use, allocated
    on a background thread in slabs of at most ``chunk_bytes``; an acquire served from them
    waits for nothing and their bytes belong to no step's ``allocated_bytes``."""
    pool = HostPool(2**30, pin=False, ahead=True, chunk_bytes=4 * MiB)
    try:
        first = pool.acquire(1 * MiB)                     # empty arena: allocated here, waited
        assert pool.allocated_bytes == MIN_SLAB_BYTES and pool.wait_seconds > 0
        pool.grow_ahead(64 * MiB)
        assert pool.wait_ahead(timeout=30)
        assert 64 * MiB <= pool.reserved_bytes < 68 * MiB       # whole chunks, to the target
        assert max(pool.slab_sizes[1:]) <= 4 * MiB             # never one huge allocation
        assert pool.ahead_bytes == pool.reserved_bytes - MIN_SLAB_BYTES
        waited, allocated = pool.wait_seconds, pool.allocated_bytes
        held = [pool.acquire(3 * MiB) for _ in range(15)]       # 45 MiB: all from ready chunks
        assert pool.wait_seconds == waited and pool.allocated_bytes == allocated
        assert_disjoint(held + [first])
    finally:
        pool.close()
    assert pool.reserved_bytes > 0                   # buffers still out keep their slabs
    for b in held + [first]:
        pool.release(b)
    assert pool.reserved_bytes == 0                  # the last one back frees everything


def test_a_slow_allocator_makes_the_wait_measurable_and_it_is_reported(monkeypatch):
    """The testing hook (``CHAMELEON_SWAP_TEST_HOST_ALLOC_DELAY``, seconds per GiB) sleeps in
    every slab allocation; an acquire that must allocate waits at least that long, and a chunk
    it waited for on the background thread counts as allocated in its step."""
    monkeypatch.setenv(host_pool.ALLOC_DELAY_ENV, "4")           # 4 s per GiB: 16 MiB = 62 ms
    pool = HostPool(2**30, pin=False, ahead=True, chunk_bytes=16 * MiB)
    try:
        assert pool.alloc_delay_s_per_gib == 4
        a = pool.acquire(16 * MiB)
        assert pool.wait_seconds >= 4 * 16 / 1024 * 0.99 and pool.allocated_bytes == 16 * MiB
        # The acquire asked for room ahead; the next one arrives while that chunk is on its
        # way and waits for it rather than allocating beside it.
        b = pool.acquire(16 * MiB)
        assert pool.allocated_bytes == 32 * MiB             # the chunk it waited for
        assert pool.wait_seconds >= 4 * 32 / 1024 * 0.99
    finally:
        pool.close()
    with pytest.raises(ValueError, match="alloc_delay_s_per_gib"):
        HostPool(2**20, pin=False, alloc_delay_s_per_gib=-1)


def test_allocating_seconds_counts_the_allocations_of_every_thread_within_a_window(monkeypatch):
    """``allocating_seconds`` (what the policy reads to tell a step slowed by pinning,
    ``checks.pinned``): slab allocations on the acquiring thread and on the grow-ahead thread
    alike, only the part inside the window, and one still under way up to the window's end.
    The real clock, with the allocator slowed by the testing hook."""
    import time
    monkeypatch.setenv(host_pool.ALLOC_DELAY_ENV, "4")           # 4 s per GiB: 16 MiB = 62 ms
    pool = HostPool(2**30, pin=False, ahead=True, chunk_bytes=16 * MiB)
    one = 4 * 16 / 1024
    try:
        t0 = time.perf_counter()
        a = pool.acquire(16 * MiB)                  # allocates on this thread, asks for more
        t1 = time.perf_counter()
        assert one * 0.99 <= pool.allocating_seconds(t0, t1) <= t1 - t0 + 1e-6
        assert pool.allocating_seconds(t1 + 10, t1 + 11) == 0.0       # nothing then
        assert pool.wait_ahead(5)                   # the background chunk landed
        t2 = time.perf_counter()
        both = pool.allocating_seconds(t0, t2)
        assert both >= 2 * one * 0.99, both         # ... and counts too
        assert pool.allocating_seconds(t1, t2) >= one * 0.99 and both <= t2 - t0 + 1e-6
        pool.grow_ahead(pool.reserved_bytes + 16 * MiB)
        time.sleep(one / 2)                         # half-way through a third
        t3 = time.perf_counter()
        assert pool.allocating_seconds(t3 - one / 2, t3) >= one / 2 * 0.8
        pool.release(a)
    finally:
        pool.close()


def test_end_step_keeps_headroom_over_recent_use_and_grows_it_off_the_step():
    pool = HostPool(2**30, pin=False, ahead=True, chunk_bytes=4 * MiB)   # one buffer a slab
    try:
        held = [pool.acquire(4 * MiB) for _ in range(8)]       # 32 MiB in use
        for b in held:
            pool.release(b)
        pool.end_step()
        assert pool.wait_ahead(timeout=30)
        assert pool.reserved_bytes >= 32 * MiB * (1 + HEADROOM_FRACTION)   # over the step's use
        allocated, waited = pool.allocated_bytes, pool.wait_seconds
        held = [pool.acquire(4 * MiB) for _ in range(10)]      # a larger step: 40 MiB
        assert pool.allocated_bytes == allocated and pool.wait_seconds == waited
        for b in held:
            pool.release(b)
        for _ in range(3):                                      # steady: nothing comes and goes
            pool.end_step()
            pool.wait_ahead(timeout=30)
            n = pool.allocations
            held = [pool.acquire(4 * MiB) for _ in range(10)]
            for b in held:
                pool.release(b)
            assert pool.allocations == n
    finally:
        pool.close()


class _Wide(torch.nn.Module):
    """Elementwise layers over rows of 256: a MiB-sized tensor per layer and row count."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.full((256,), 1.0 + i / 10))
                                        for i in range(6))

    def forward(self, x):
        for w in self.w:
            x = torch.tanh(x * w)
        return x.sum()


def test_with_a_slow_allocator_steps_after_the_first_wait_for_nothing_grown_ahead(monkeypatch):
    """Issue 19, item 1, through the engine, on a schedule that grows and shrinks (each new
    size at most 1.125 times the most recent use: within ``HEADROOM_FRACTION``, 0.5, with room
    for what slabs sized for other tensors waste, up to a tensor a slab; 1.2 times failed once
    in a full suite, the slabs grown during a step being as the threads' timing made them). With the allocator slowed on purpose the first
    step waits (and says so in ``host_wait_seconds``); once the background thread has grown the
    arena ahead (``wait_ahead``: what the time between steps gives it), no later step allocates
    on its own thread or waits; every loss and gradient is bitwise the plain run's."""
    monkeypatch.setenv(host_pool.ALLOC_DELAY_ENV, "2")         # 2 s per GiB
    model = _Wide()
    rows = [2048, 2304, 2560, 2816, 2048, 2560, 2816]
    batches = [randn_rows(n, seed=i) for i, n in enumerate(rows)]
    ref, test = copy.deepcopy(model), copy.deepcopy(model)
    with cs.Chameleon(0, device="cpu", policy="guard") as eng:
        assert eng._pool.alloc_delay_s_per_gib == 2
        for i, b in enumerate(batches):
            ref.zero_grad(set_to_none=True)
            test.zero_grad(set_to_none=True)
            loss_ref = train_step(ref, b)
            loss = train_step(test, b, eng)
            assert_bitwise(loss_ref, grads(ref), loss, grads(test))
            s = eng.last_step
            assert s.offloaded_tensors > 0
            if i == 0:
                assert s.host_allocated_bytes > 0 and s.host_wait_seconds > 0
            else:
                assert s.host_allocated_bytes == 0 and s.host_wait_seconds == 0, (i, s)
            assert eng._pool.wait_ahead(timeout=60)
        assert eng.totals.host_wait_seconds == eng.history[0].host_wait_seconds


def randn_rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 256, generator=torch.Generator().manual_seed(seed))


def test_a_reserve_ready_before_it_is_needed_belongs_to_no_step_one_waited_for_does():
    """Issue 19, item 6: ``host_memory_reserve`` allocated before anything needed it is not in
    ``allocated_bytes`` (a step's ``host_allocated_bytes``); one an acquire had to wait for
    (the allocator slowed on purpose) is, with the wait in ``wait_seconds``."""
    ready = HostPool(64 * MiB, pin=False, reserve_bytes=8 * MiB)
    assert ready.wait_reserve(timeout=60)
    b = ready.acquire(MiB)
    assert ready.allocated_bytes == 0 and ready.wait_seconds == 0
    assert ready.ahead_bytes == 8 * MiB and ready.allocations == 1
    ready.release(b)
    ready.close()
    slow = HostPool(64 * MiB, pin=False, reserve_bytes=8 * MiB, alloc_delay_s_per_gib=32)
    b = slow.acquire(MiB)                            # 8 MiB at 32 s/GiB: 250 ms, waited for
    assert slow.allocated_bytes == 8 * MiB and slow.ahead_bytes == 0
    assert slow.wait_seconds > 0 and slow.allocations == 1
    slow.release(b)
    slow.close()


@pytest.fixture
def held_allocator(monkeypatch):
    """Every slab allocation waits until the test sets the event this yields (and at its end)."""
    gate = threading.Event()
    made = host_pool.HostPool._new_slab

    def held_slab(self, size):
        assert gate.wait(timeout=60), "the allocator was never let go"
        return made(self, size)

    monkeypatch.setattr(host_pool.HostPool, "_new_slab", held_slab)
    yield gate
    gate.set()


def test_ready_never_allocates_on_the_calling_thread_and_asks_the_background_one(
        held_allocator):
    """Issue 19, item 1: ``ready(nbytes)`` says whether a free range fits now. It allocates and
    waits for nothing: here the allocator is held until the test lets it go, and ``ready``
    returns meanwhile. With ``ahead`` a no asks the background thread for room, so a later
    ``ready`` says yes and the ``acquire`` after it waits for nothing."""
    gate = held_allocator
    # (A delay per GiB marks allocating as slow, as pinning is: plain fast RAM is always ready.)
    assert HostPool(2**30, pin=False).ready(MiB)
    pool = HostPool(2**30, pin=False, ahead=True, chunk_bytes=4 * MiB, alloc_delay_s_per_gib=1e-9)
    try:
        assert not pool.ready(MiB)                    # empty: returns while the grow thread waits
        assert not pool.ready(MiB)
        assert pool.allocations == 0 and pool.wait_seconds == 0 and pool.reserved_bytes == 0
        gate.set()
        assert pool.wait_ahead(timeout=60)
        assert pool.reserved_bytes >= MiB and pool.ready(MiB)
        b = pool.acquire(MiB)
        assert pool.wait_seconds == 0 and pool.allocated_bytes == 0   # ready: belonged to no step
        pool.release(b)
    finally:
        gate.set()
        pool.close()
    plain = HostPool(2**30, pin=False, alloc_delay_s_per_gib=1e-9)   # no grow-ahead: a no stays
    assert not plain.ready(MiB) and plain.allocations == 0
    b = plain.acquire(3 * MiB)
    assert plain.ready(MiB) and not plain.ready(8 * MiB)
    plain.release(b)
    plain.close()


def test_room_asks_for_a_steps_moves_in_all_and_the_steps_end_keeps_them():
    """``room(n)``: whether ``n`` bytes are free in all (a step's moves, not one tensor's range),
    never waiting. On a slow arena a no asks the background thread for them and counts them as
    the step's want, which its end keeps (and grows 1.5x ahead) instead of trimming; with
    ``ask=False`` it only answers. Plain fast RAM always has room (a step with no plan asks it
    before keeping blocks whose moves would wait for pinning: ``policy/host_room.py``)."""
    assert HostPool(2**30, pin=False).room(2**29)
    pool = HostPool(2**30, pin=False, ahead=True, chunk_bytes=4 * MiB, alloc_delay_s_per_gib=1e-9)
    try:
        assert not pool.room(10 * MiB, ask=False)
        assert pool.wait_ahead(timeout=60) and pool.reserved_bytes == 0      # (not asked)
        assert not pool.room(10 * MiB)
        assert pool.wait_seconds == 0 and pool.allocated_bytes == 0
        assert pool.wait_ahead(timeout=60) and pool.reserved_bytes >= 10 * MiB
        assert pool.room(10 * MiB) and pool.room(6 * MiB, ask=False)
        held = pool.acquire(4 * MiB)                # in use: the free room is what is left
        assert not pool.room(pool.reserved_bytes, ask=False)
        pool.release(held)
        pool.end_step()                             # the want (10 MiB) is kept, and 1.5x of it
        assert pool.wait_ahead(timeout=60) and pool.reserved_bytes >= 15 * MiB
        for _ in range(3):
            pool.end_step()                         # steps that want nothing: kept for the
        assert pool.reserved_bytes >= 15 * MiB      # window (TRIM_WINDOW steps)
        assert pool.allocated_bytes == 0            # all of it grown ahead, off the steps
    finally:
        pool.close()


def test_growth_ahead_stops_short_of_the_machines_floor_and_a_step_still_gets_its_memory():
    # A machine of 1 GiB: growing ahead may leave it a quarter (256 MiB) available, no less. Two
    # engines of one process, each within its own limit, once grew ahead past the machine's RAM
    # on an H200 host and the kernel killed the process.
    free = {"bytes": 280 * MiB}              # available before this arena takes any
    pool = HostPool(2**30, pin=False, ahead=True, chunk_bytes=16 * MiB,
                    machine_memory=lambda: (free["bytes"] - pool.reserved_bytes, 2**30))
    try:
        held = [pool.acquire(16 * MiB) for _ in range(4)]      # 64 MiB in use
        for b in held:
            pool.release(b)
        pool.end_step()                                         # asks for 1.5x that: 96 MiB
        assert pool.wait_ahead(timeout=30)
        assert pool.reserved_bytes < 64 * MiB * (1 + HEADROOM_FRACTION)   # held at the floor
        free["bytes"] = 2**30                                   # room again: it grows ahead
        pool.end_step()
        assert pool.wait_ahead(timeout=30)
        assert pool.reserved_bytes >= 64 * MiB * (1 + HEADROOM_FRACTION)
        assert pool.ahead_bytes > 0
        free["bytes"] = 0                                       # none: a step's need still wins
        held = [pool.acquire(16 * MiB) for _ in range(12)]      # 192 MiB, past what grew ahead
        assert pool.in_use_bytes == 192 * MiB
        for b in held:
            pool.release(b)
    finally:
        pool.close()


@pytest.mark.parametrize("present", [("accelerator",), ("_accelerator_emptyHostCache",),
                                     ("_host_emptyCache",), ()])
def test_the_pinned_cache_is_emptied_under_whichever_name_this_torch_gives_it(monkeypatch,
                                                                              present):
    # torch 2.13 names it torch.accelerator.empty_host_cache (and torch._C's
    # _accelerator_emptyHostCache); older versions only torch._C._host_emptyCache.
    calls = []
    accelerator = types.SimpleNamespace()
    if "accelerator" in present:
        accelerator.empty_host_cache = lambda: calls.append("accelerator")
    monkeypatch.setattr(torch, "accelerator", accelerator)
    for name in ("_accelerator_emptyHostCache", "_host_emptyCache"):
        monkeypatch.delattr(torch._C, name, raising=False)
        if name in present:
            monkeypatch.setattr(torch._C, name, lambda n=name: calls.append(n), raising=False)
    assert host_pool._empty_host_cache() is bool(present)
    assert calls == list(present)


def test_would_block_says_when_an_acquire_would_wait_and_changes_nothing(monkeypatch):
    """``would_block``: the executor times such an acquire as a wait (``host_block``). Plain RAM
    never blocks; a slow arena does when no slab has room, and asking grows nothing."""
    assert not HostPool(2**30, pin=False).would_block(MiB)
    slow = HostPool(2**30, pin=False, alloc_delay_s_per_gib=1e-9)
    assert slow.would_block(MiB) and slow.reserved_bytes == 0 and slow._pending == 0
    buf = slow.acquire(MiB)                                 # grows a 2 MiB slab
    assert not slow.would_block(MiB)                        # the other half is free
    assert slow.would_block(4 * MiB)
    slow.release(buf)
    assert not slow.would_block(2 * MiB)
    late = HostPool(64 * MiB, pin=False, reserve_bytes=8 * MiB, alloc_delay_s_per_gib=32)
    assert late.would_block(MiB)                            # the reserve is still being made
    assert late.wait_reserve(timeout=30) and not late.would_block(MiB)


def test_a_size_whose_tensors_outgrow_the_chunks_allocates_on_its_first_visit_only():
    """Sizes alternate: one of many small tensors (which fills the arena's kept room with
    chunk-sized slabs), one using less in all but with tensors larger than a chunk (which only
    slabs allocated for them can hold). The second size allocates on its first visit and never again, and waits
    for nothing after it: the step's end trims slabs too small for the largest recent request
    first. Trimmed largest-first, its slabs went back at each of its steps' ends and every
    visit allocated them again (on CUDA, pinning them inside the step)."""
    pool = HostPool(2**30, pin=False, ahead=True, chunk_bytes=MiB,
                    machine_memory=lambda: (None, None))
    small, large = [256 * KiB] * 64, [64 * KiB] * 8 + [3 * MiB] * 2   # 16 MiB, 6.5 MiB
    try:
        allocated = []
        for sizes in [small, small, large, small, large, small, large, large]:
            before, waited = pool.allocations, pool.wait_seconds
            held = [pool.acquire(n) for n in sizes]
            assert_disjoint(held)
            for b in held:
                pool.release(b)
            pool.end_step()
            assert pool.wait_ahead(timeout=30)
            allocated.append((sizes is large, pool.allocations - before,
                              pool.wait_seconds > waited))
        assert allocated[2][1] > 0                         # the large size's first visit
        assert [a for a in allocated[3:] if a[0] and (a[1] or a[2])] == []
        assert sorted(pool.slab_sizes) == pool.slab_sizes  # kept in size order
        assert sum(n >= 3 * MiB for n in pool.slab_sizes) >= 2
    finally:
        pool.close()


def test_a_request_takes_the_smallest_slab_it_fits_and_leaves_the_large_one_whole():
    pool = HostPool(2**30, pin=False)
    with pool._lock:                                 # slabs added oldest-largest (as ahead)
        for size in (8 * MiB, MiB, 2 * MiB):
            pool._add_locked(host_pool._Slab(size, False))
    assert pool.slab_sizes == [MiB, 2 * MiB, 8 * MiB]
    held = [pool.acquire(256 * KiB) for _ in range(4)] + [pool.acquire(512 * KiB)]
    assert [b.slab.size for b in held] == [MiB] * 4 + [2 * MiB]
    whole = pool.acquire(8 * MiB)                    # the large slab is still whole
    assert whole.slab.size == 8 * MiB and pool.allocations == 3


def test_room_asks_nothing_while_the_reserve_is_being_allocated(held_allocator):
    """``room`` while ``host_memory_reserve``'s slab is still being allocated answers no and asks
    the grow thread for nothing (as ``ready``): growing beside the reserve could pass the limit."""
    gate = held_allocator
    pool = HostPool(64 * MiB, pin=False, reserve_bytes=8 * MiB, ahead=True,
                    alloc_delay_s_per_gib=1e-9)
    try:
        assert not pool.room(MiB) and pool._pending == 0 and pool._target == 0
        gate.set()
        assert pool.wait_reserve(timeout=60) and pool.room(MiB)
    finally:
        gate.set()
        pool.close()

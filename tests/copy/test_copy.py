"""Unit tests of the copy layer on CPU: ``CpuCopyEngine``, ``make_copy_engine`` and the bandwidth
helpers (the host arena has its own, ``test_host_pool.py``).

The CPU copy engine is what every CPU test of the engine runs on, and it is built to make ordering
and lifetime bugs visible (worker threads, weak references, optional delays), so its own contract
is checked here directly: bytes round-trip, a fetch waits for the copy-out it depends on, deferred
callbacks run only from ``poll()`` once their copy is done, a source freed too early is an error and
never garbage, and the worker threads stop.
"""
from __future__ import annotations

import gc
import math
import threading
import time
import weakref

import pytest
import torch

import chameleon_swap as cs
from chameleon_swap.copy import bandwidth, make_copy_engine
from chameleon_swap.copy.cpu import CpuCopyEngine, CpuTicket

KiB = 2**10


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")   # see conftest.py


@pytest.fixture
def eng():
    e = CpuCopyEngine(delay_s=0.0)
    yield e
    e.close()


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


# =========================================================================== CpuCopyEngine
def test_make_copy_engine_cpu():
    e = make_copy_engine(torch.device("cpu"))
    try:
        assert isinstance(e, CpuCopyEngine)
        assert e.device == torch.device("cpu")
        assert e.record_ready() is None              # CPU compute is synchronous
    finally:
        e.close()
    e = make_copy_engine(torch.device("cpu"), delay_s=0.01)   # kwargs reach the CPU engine
    try:
        assert e.delay_s == 0.01
    finally:
        e.close()
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        make_copy_engine(torch.device("meta"))


def test_delay_from_environment_and_explicit_override(monkeypatch):
    monkeypatch.setenv("CHAMELEON_SWAP_TEST_COPY_DELAY", "0.004")
    e = CpuCopyEngine()
    try:
        assert e.delay_s == 0.004
        assert e._d2h.delay_s == e._h2d.delay_s == 0.004
    finally:
        e.close()
    e = CpuCopyEngine(delay_s=0.0)
    try:
        assert e.delay_s == 0.0
    finally:
        e.close()
    monkeypatch.setenv("CHAMELEON_SWAP_TEST_COPY_DELAY", "")
    e = CpuCopyEngine()
    try:
        assert e.delay_s == 0.0
    finally:
        e.close()


@pytest.mark.parametrize("n", [1, 4096, 100_003])
def test_offload_fetch_round_trip_of_random_bytes(eng, n):
    src = random_bytes(n, seed=n)
    expect = src.clone()
    host = torch.zeros(n, dtype=torch.uint8)
    t_out = eng.offload(src, host, None)
    eng.wait_host(t_out)
    assert t_out.done() and t_out.error is None
    assert torch.equal(host, expect)
    back, t_in = eng.fetch(host, t_out)
    assert back.dtype == torch.uint8 and back.shape == (n,) and back.data_ptr() != host.data_ptr()
    eng.wait(t_in)
    assert torch.equal(back, expect)
    eng.synchronize()
    assert len(eng._deferred) == 0


def test_fetch_after_an_offload_ticket_is_ordered_after_it_even_when_the_offload_is_slow():
    e = CpuCopyEngine(delay_s=0.0)
    try:
        e._d2h.delay_s = 0.1                         # only copies out are slow
        src = random_bytes(50_000, seed=3)
        host = torch.zeros(50_000, dtype=torch.uint8)
        t_out = e.offload(src, host, None)
        back, t_in = e.fetch(host, t_out)            # issued before the copy out even started
        assert not t_out.done()
        e.wait(t_in)
        assert t_out.done()                          # the copy back waited for the copy out
        assert torch.equal(back, src)                # so it read the final bytes, not zeros
    finally:
        e.close()


def test_fetch_does_not_run_before_its_after_ticket_is_done(eng):
    gate = CpuTicket()
    host = random_bytes(1000, seed=4)
    back, t_in = eng.fetch(host, gate)
    time.sleep(0.05)
    assert not t_in.done()                           # blocked on the gate
    gate._finish()
    eng.wait(t_in)
    assert torch.equal(back, host)


def test_fetch_after_a_failed_copy_fails_too(eng):
    gate = CpuTicket()
    gate._finish("disk on fire")
    back, t_in = eng.fetch(random_bytes(10), gate)
    with pytest.raises(RuntimeError, match="depends on a failed copy: disk on fire"):
        eng.wait(t_in)


def test_wait_returns_whether_the_copy_was_late_and_counts_the_stall():
    e = CpuCopyEngine(delay_s=0.05)
    try:
        assert e.take_stall_seconds() == 0.0
        back, t = e.fetch(random_bytes(100), None)
        assert e.wait(t) is True                     # not done when asked: late
        stall = e.take_stall_seconds()
        assert 0.02 < stall < 5.0
        assert e.take_stall_seconds() == 0.0         # taking resets the counter
        assert e.wait(t) is False                    # done already: on time, no stall
        assert e.take_stall_seconds() == 0.0
    finally:
        e.close()


def test_wait_host_blocks_until_done_and_returns_the_wait():
    e = CpuCopyEngine(delay_s=0.05)
    try:
        src = random_bytes(5000, seed=5)
        host = torch.zeros(5000, dtype=torch.uint8)
        t = e.offload(src, host, None)
        dt = e.wait_host(t)
        assert t.done() and torch.equal(host, src)
        assert isinstance(dt, float) and 0.02 < dt < 5.0
        assert e.take_stall_seconds() >= dt
        assert e.wait_host(t) < 0.02                 # already done
    finally:
        e.close()


def test_copy_errors_surface_at_wait_and_wait_host(eng):
    src = random_bytes(100)
    too_small = torch.zeros(10, dtype=torch.uint8)   # copy_ cannot broadcast 100 into 10
    t = eng.offload(src, too_small, None)
    with pytest.raises(RuntimeError, match="chameleon-swap copy failed"):
        eng.wait_host(t)
    with pytest.raises(RuntimeError, match="chameleon-swap copy failed"):
        eng.wait(t)


def test_defer_runs_callbacks_from_poll_only_once_the_ticket_is_done(eng):
    gate = CpuTicket()
    back, t = eng.fetch(random_bytes(64), gate)
    calls = []
    eng.defer(t, lambda: calls.append(threading.current_thread()))
    eng.poll()
    assert calls == []                               # not done: nothing runs
    gate._finish()
    t._block()
    assert calls == []                               # done, but callbacks run only from poll()
    eng.poll()
    assert calls == [threading.current_thread()]     # on the polling thread
    eng.poll()
    assert len(calls) == 1                           # once


def test_defer_keeps_an_object_alive_until_done_and_polled(eng):
    gate = CpuTicket()
    _, t = eng.fetch(random_bytes(64), gate)
    keep = torch.ones(10)
    ref = weakref.ref(keep)
    eng.defer(t, keep=keep)
    del keep
    gc.collect()
    assert ref() is not None                         # held while the copy is pending
    eng.poll()
    assert ref() is not None
    gate._finish()
    t._block()
    eng.poll()
    gc.collect()
    assert ref() is None                             # dropped by the first poll after completion


def test_poll_reaps_out_of_order_completions_and_batches():
    e = CpuCopyEngine(delay_s=0.0)
    try:
        e._d2h.delay_s = 0.3                         # copy out slow, copy back fast
        slow = e.offload(random_bytes(64), torch.zeros(64, dtype=torch.uint8), None)
        done = []
        e.defer(slow, lambda: done.append("slow"))
        fast = []
        for i in range(5):
            _, t = e.fetch(random_bytes(64, seed=i), None)
            e.defer(t, lambda i=i: fast.append(i))
        # Wait for the fast ones only.
        for entry in list(e._deferred):
            if entry[0] is not slow:
                entry[0]._block()
        e.poll()
        assert fast == [0, 1, 2, 3, 4]               # all reaped by one poll, in issue order
        assert done == []                            # the slow one did not block them, nor ran
        e.synchronize()
        assert done == ["slow"]
    finally:
        e.close()


def test_a_callback_may_defer_more_work(eng):
    _, t1 = eng.fetch(random_bytes(8), None)
    _, t2 = eng.fetch(random_bytes(8), None)
    order = []
    eng.defer(t1, lambda: (order.append(1), eng.defer(t2, lambda: order.append(2))))
    eng.synchronize()
    eng.poll()
    assert order == [1, 2]
    assert len(eng._deferred) == 0


def test_offload_keeps_its_source_alive_until_the_copy_is_done():
    e = CpuCopyEngine(delay_s=0.1)
    try:
        src = random_bytes(10_000, seed=6)
        expect = src.clone()
        host = torch.zeros(10_000, dtype=torch.uint8)
        ref = weakref.ref(src)
        t = e.offload(src, host, None)
        del src                                      # the caller lets go at once
        gc.collect()
        assert ref() is not None                     # the engine holds it (deferred free)
        e.wait_host(t)
        assert torch.equal(host, expect)
        e.poll()
        gc.collect()
        assert ref() is None                         # and lets go once the copy is done
    finally:
        e.close()


def test_a_source_freed_before_its_copy_ran_is_a_clear_error_not_garbage():
    e = CpuCopyEngine(delay_s=0.0)
    try:
        e._d2h.delay_s = 0.3
        src = random_bytes(4096, seed=7)
        host = torch.full((4096,), 7, dtype=torch.uint8)
        t = e.offload(src, host, None)
        e._deferred.clear()                          # simulate a lost keep-alive
        del src
        gc.collect()
        with pytest.raises(RuntimeError, match="source was freed before its copy ran"):
            e.wait_host(t)
        assert torch.equal(host, torch.full((4096,), 7, dtype=torch.uint8))  # untouched
        back, t2 = e.fetch(host, t)                  # and what depends on it fails too
        with pytest.raises(RuntimeError, match="depends on a failed copy"):
            e.wait(t2)
        # Same on the copy back: a host source that vanished is an error at wait().
        gate = CpuTicket()
        hsrc = random_bytes(128)
        back, t3 = e.fetch(hsrc, gate)
        e._deferred.clear()
        del hsrc
        gc.collect()
        gate._finish()
        with pytest.raises(RuntimeError, match="source was freed before its copy ran"):
            e.wait(t3)
    finally:
        e.close()


def test_synchronize_waits_for_everything_and_runs_callbacks():
    e = CpuCopyEngine(delay_s=0.005)
    try:
        srcs = [random_bytes(2000, seed=i) for i in range(8)]
        hosts = [torch.zeros(2000, dtype=torch.uint8) for _ in srcs]
        tickets = [e.offload(s, h, None) for s, h in zip(srcs, hosts)]
        fetched = [e.fetch(h, t) for h, t in zip(hosts, tickets)]
        ran = []
        for i, t in enumerate(tickets):
            e.defer(t, lambda i=i: ran.append(i))
        e.synchronize()
        assert all(t.done() for t in tickets) and all(t.done() for _, t in fetched)
        assert sorted(ran) == list(range(8))
        assert len(e._deferred) == 0
        for s, (back, _) in zip(srcs, fetched):
            assert torch.equal(back, s)
    finally:
        e.close()


def test_close_finishes_pending_copies_and_stops_the_workers():
    e = CpuCopyEngine(delay_s=0.02)
    workers = (e._d2h, e._h2d)
    assert all(w.is_alive() for w in workers)
    src = random_bytes(1000)
    host = torch.zeros(1000, dtype=torch.uint8)
    t = e.offload(src, host, None)
    e.close()
    assert t.done() and torch.equal(host, src)
    for w in workers:
        w.join(timeout=5)
    assert not any(w.is_alive() for w in workers)


def test_workers_stop_when_the_engine_is_garbage_collected():
    e = CpuCopyEngine(delay_s=0.0)
    workers = (e._d2h, e._h2d)
    assert all(w.is_alive() for w in workers)
    del e
    gc.collect()
    for w in workers:
        w.join(timeout=5)
    assert not any(w.is_alive() for w in workers)


# =========================================================================== bandwidth
def test_measure_bandwidth_cpu_small():
    r = bandwidth.measure_bandwidth("cpu", nbytes=64 * KiB, repeats=3)
    assert isinstance(r, bandwidth.BandwidthResult)
    assert r.device == "cpu" and r.method == "cpu-memcpy" and r.pinned is False
    assert r.nbytes == 64 * KiB and r.repeats == 3
    for v in (r.h2d_bytes_per_s, r.d2h_bytes_per_s):
        assert isinstance(v, float) and math.isfinite(v) and v > 0
    r1 = bandwidth.measure_bandwidth(torch.device("cpu"), nbytes=1, repeats=1)
    assert math.isfinite(r1.h2d_bytes_per_s) and r1.h2d_bytes_per_s > 0   # timer floor, no /0


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(nbytes=0), ValueError, "nbytes"),
    (dict(nbytes=True), TypeError, "nbytes"),
    (dict(nbytes=1.5), TypeError, "nbytes"),
    (dict(repeats=0), ValueError, "repeats"),
    (dict(repeats=False), TypeError, "repeats"),
])
def test_measure_bandwidth_rejects_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        bandwidth.measure_bandwidth("cpu", **{"nbytes": 1024, **kwargs})


def test_resolve_device():
    assert bandwidth.resolve_device("cpu") == torch.device("cpu")
    assert bandwidth.resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert bandwidth.resolve_device("cpu:0") == torch.device("cpu")
    with pytest.raises(TypeError, match="dev"):
        bandwidth.resolve_device(0, "dev")
    with pytest.raises(ValueError, match="dev must be 'cpu' or 'cuda"):
        bandwidth.resolve_device("meta", "dev")
    with pytest.raises(ValueError, match="could not parse"):
        bandwidth.resolve_device("not a device")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            bandwidth.resolve_device("cuda")


def test_cached_bandwidth_measures_once_per_device(monkeypatch):
    calls = []
    real = bandwidth.measure_bandwidth

    def small(device, nbytes=bandwidth.DEFAULT_NBYTES, repeats=bandwidth.DEFAULT_REPEATS):
        calls.append(device)
        return real(device, nbytes=16 * KiB, repeats=1)

    monkeypatch.setattr(bandwidth, "measure_bandwidth", small)
    bandwidth.clear_bandwidth_cache()
    try:
        a = bandwidth.cached_bandwidth("cpu")
        b = bandwidth.cached_bandwidth(torch.device("cpu"))
        assert a is b and len(calls) == 1
        bandwidth.clear_bandwidth_cache()
        c = bandwidth.cached_bandwidth("cpu")
        assert c is not a and len(calls) == 2
    finally:
        bandwidth.clear_bandwidth_cache()


def test_pinned_memory_status_without_cuda():
    ok, why = bandwidth.pinned_memory_status()
    assert isinstance(ok, bool) and isinstance(why, str) and why
    if not torch.cuda.is_available():
        assert ok is False and "no CUDA" in why


# --------------------------------------------------------------------------- byte copies
def test_copy_bytes_copies_exactly_and_refuses_what_it_cannot_copy():
    from chameleon_swap.copy.cpu import copy_bytes
    src = torch.arange(1000, dtype=torch.int64).view(torch.uint8)   # 8000 bytes, all distinct-ish
    dst = torch.zeros_like(src)
    copy_bytes(dst, src)
    assert torch.equal(dst, src)
    copy_bytes(torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8))  # no-op
    for bad_dst, bad_src in [(torch.empty(7999, dtype=torch.uint8), src),           # sizes differ
                             (torch.empty(1000, dtype=torch.int64), src),           # not bytes
                             (torch.empty(16000, dtype=torch.uint8)[::2], src)]:    # strided
        with pytest.raises(RuntimeError, match="contiguous uint8"):
            copy_bytes(bad_dst, bad_src)


# ------------------------------------------------------------------ the emulated link
@pytest.mark.parametrize("threads", [False, True], ids=["clock", "threads"])
def test_the_emulated_link_makes_copies_last_their_bytes_over_its_bandwidth(threads):
    # On the link's clock (the default) or on the copy threads (the ordering tests' way).
    e = CpuCopyEngine(bytes_per_s=20e6, threads=threads)    # 20 MB/s: 1 MB takes 50 ms
    try:
        src = torch.arange(2**20, dtype=torch.int32).to(torch.uint8)
        dst = torch.empty_like(src)
        t0 = time.perf_counter()
        ticket = e.offload(src, dst, e.record_ready())
        issued = time.perf_counter() - t0
        e.wait_host(ticket)
        took = time.perf_counter() - t0
        assert issued < 0.02 < 0.045 <= took               # the caller waits only when it asks
        assert torch.equal(src, dst)
        back, t2 = e.fetch(dst, ticket)
        e.wait(t2)
        assert torch.equal(back, src)
        link = e.take_link()
        assert link["d2h"][0] == link["h2d"][0] == 2**20
        assert 15e6 < link["d2h"][0] / link["d2h"][1] <= 20e6 * 1.01   # measured: about 20 MB/s
        assert e.take_link() == {"d2h": (0, 0.0), "h2d": (0, 0.0)}     # taking resets
        assert [slot for slot, _ in e.take_stalls()] == [-1, -1]       # no profiler: no slot
    finally:
        e.close()


def test_the_copy_threads_cpu_counts_their_copies_not_the_emulated_links_sleep():
    # 2 MB each way at 20 MB/s: the copies last 200 ms, their memmoves and Python a millisecond
    # or so. take_cpu counts the threads' CPU (part of what a move costs the step), not the
    # sleep, and taking resets it.
    e = CpuCopyEngine(bytes_per_s=20e6, threads=True)
    try:
        src = torch.arange(2 * 2**20, dtype=torch.int32).to(torch.uint8)
        dst = torch.empty_like(src)
        ticket = e.offload(src, dst, e.record_ready())
        back, t2 = e.fetch(dst, ticket)
        e.wait(t2)
        cpu = e.take_cpu()
        slept = sum(s for _, s in e.take_link().values())
        assert slept >= 0.18 and 0 < cpu < 0.05, (cpu, slept)
        assert e.take_cpu() == 0.0
    finally:
        e.close()
    assert make_copy_engine(torch.device("cpu")).take_cpu() == 0.0   # nothing copied yet


def test_the_links_clock_queues_each_direction_and_orders_a_fetch_after_its_copy_out():
    e = CpuCopyEngine(bytes_per_s=20e6)                     # the clock: no copy threads
    try:
        assert e.clocked and not isinstance(e._d2h, threading.Thread)
        a, b = random_bytes(2**20, seed=1), random_bytes(2**20, seed=2)
        ha, hb = torch.zeros_like(a), torch.zeros_like(b)
        t0 = time.perf_counter()
        ta, tb = e.offload(a, ha, None), e.offload(b, hb, None)
        assert torch.equal(ha, a) and torch.equal(hb, b)    # the bytes moved at issue
        assert not ta.done() and not tb.done()
        assert tb.ready_at - ta.ready_at >= 0.05 - 1e-6     # the second queued behind the first
        back, tc = e.fetch(hb, tb)                          # back only after b's copy out
        assert tc.ready_at - tb.ready_at >= 0.05 - 1e-6
        assert e.wait(tc) is True and time.perf_counter() - t0 >= 0.149
        assert ta.done() and tb.done() and torch.equal(back, b)
        assert e.take_cpu() == 0.0                          # the memmoves were the caller's
        bad = e.offload(random_bytes(100), torch.zeros(10, dtype=torch.uint8), None)
        with pytest.raises(RuntimeError, match="chameleon-swap copy failed"):
            e.wait(bad)
        _, after_bad = e.fetch(random_bytes(10), bad)
        with pytest.raises(RuntimeError, match="depends on a failed copy"):
            e.wait(after_bad)
    finally:
        e.close()
    with pytest.raises(ValueError, match="threads=False needs bytes_per_s"):
        CpuCopyEngine(threads=False)


def test_on_the_links_clock_a_poll_runs_each_callback_once_its_copy_is_done():
    # A poll on the clock skips the list until its first copy is done; a copy deferred later but
    # done sooner (the other direction's, or a failed one) moves that moment earlier.
    e = CpuCopyEngine(bytes_per_s=20e6)
    try:
        ran = []
        big = e.offload(random_bytes(2**23), torch.zeros(2**23, dtype=torch.uint8), None)
        e.defer(big, lambda: ran.append("big"))             # 8 MB: done after 420 ms
        small = e.fetch_into(random_bytes(2**16), torch.zeros(2**16, dtype=torch.uint8), None)
        e.defer(small, lambda: ran.append("small"))         # other direction, 64 KB: ~3 ms
        e.poll()
        assert ran == [] or time.perf_counter() >= small.ready_at
        while not small.done():
            time.sleep(0.001)
        e.poll()
        assert ran == ["small"] and not big.done()
        bad = e.offload(random_bytes(100), torch.zeros(10, dtype=torch.uint8), None)
        e.defer(bad, lambda: ran.append("failed"))          # a failed copy is done at once
        e.poll()
        assert ran == ["small", "failed"] and not big.done()
        e.synchronize()
        assert ran == ["small", "failed", "big"]
    finally:
        e.close()


def test_emulate_link_is_checked_and_cpu_only():
    with pytest.raises(ValueError, match="emulate_link"):
        cs.Chameleon(1000, device="cpu", emulate_link="fast")
    with pytest.raises(ValueError, match="emulate_link"):
        cs.Chameleon(1000, device="cpu", emulate_link=-1)
    with cs.Chameleon(1000, device="cpu", emulate_link="5MB/s") as eng:
        assert eng._bandwidth() == (5e6, 5e6)              # the planner assumes the emulated link
    with cs.Chameleon(1000, device="cpu", emulate_link="5MB/s", link_bandwidth="1GB/s") as eng:
        assert eng._bandwidth() == (1e9, 1e9)              # unless told otherwise

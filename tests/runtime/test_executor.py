"""Executor holds: bytes counted as resident that the saved-tensor hooks cannot see."""
from __future__ import annotations

import pytest
import torch

from chameleon_swap.copy import make_copy_engine
from chameleon_swap.copy.host_pool import HostPool
from chameleon_swap.runtime.executor import Executor


@pytest.fixture
def ex():
    copy = make_copy_engine(torch.device("cpu"))
    yield Executor(torch.device("cpu"), copy, HostPool(2**20, pin=False), min_tensor_bytes=0)
    copy.close()


def test_holds_count_as_resident_and_in_the_peak(ex):
    ex.begin_step(None)
    a = ex.hold(100)
    b = ex.hold(50)
    assert ex.resident_bytes == 150 and ex.held_bytes == 150
    ex.release_hold(a)
    c = ex.hold(20)
    assert ex.resident_bytes == 70 and ex.held_bytes == 70
    assert ex.stats.peak_resident_bytes == 150
    assert len({a, b, c}) == 3


def test_release_is_idempotent_and_end_step_leaves_holds_to_their_owner(ex):
    ex.begin_step(None)
    t = ex.hold(64)
    ex.end_step(failed=True)
    assert ex.resident_bytes == 64 and ex.held_bytes == 64
    ex.begin_step(None)                        # a new step starts its peak from what is held
    assert ex.stats.peak_resident_bytes == 64
    ex.release_hold(t)
    ex.release_hold(t)
    ex.release_hold(12345)                     # never given: nothing to do
    assert ex.resident_bytes == 0 and ex.held_bytes == 0


@pytest.mark.parametrize("nbytes, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError),
                                           ("1KB", TypeError)])
def test_hold_rejects_what_is_not_a_byte_count(ex, nbytes, error):
    with pytest.raises(error, match="nbytes must be"):
        ex.hold(nbytes)
    assert ex.resident_bytes == 0


def test_a_handle_freed_on_another_thread_never_waits_for_the_lock():
    """A handle can die on any thread: cyclic garbage is collected by whichever thread allocates
    next, a copy worker included. While the executor's lock is held (the caller may be waiting
    for that very worker's copy: a full-suite run hung so, a d2h worker collecting a graph inside
    its ticket's Event.set) the dying handle must not wait for the lock; its record is released
    at the next step boundary instead."""
    import threading

    import chameleon_swap as cs

    with cs.Chameleon(0, device="cpu", min_tensor_bytes=0) as eng:
        x = torch.randn(64, 64, requires_grad=True)
        with eng.step():
            graph = [x.sin().exp().sum()]          # saved tensors, moved to host (budget 0)
            assert eng._ex.live
            dropper = threading.Thread(target=graph.clear, name="chameleon-test-dropper")
            with eng._ex.lock:                     # held, as while waiting for a copy
                dropper.start()
                dropper.join(timeout=10)
                stuck = dropper.is_alive()
            dropper.join()
            assert not stuck, "a handle freed on another thread waited for the executor's lock"
        assert eng.resident_bytes == 0 and eng.records_alive == 0 and eng.host_bytes_in_use == 0

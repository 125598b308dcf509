"""Executor: holds (bytes counted as resident that the saved-tensor hooks cannot see) and the
storage -> record map."""
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


class _StreamLog(torch.utils._python_dispatch.TorchDispatchMode):
    """A CPU stand-in for the CUDA sanitizer's view of the compute stream: every op run on it is
    logged with the data pointers it writes. The classification follows the rule torch 2.13's
    ``torch/cuda/_sanitizer.py`` applies (facts, not its code): an argument whose schema alias is
    marked ``!`` is written; an output is written unless it is a view (aliased, not ``!``) or the
    op is a factory; views read nothing."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        factory = schema.name.split("::")[-1].startswith(("empty", "zeros", "ones", "full",
                                                          "rand", "arange"))
        written = []
        flat = dict(zip((a.name for a in schema.arguments), args), **kwargs)
        for a in schema.arguments:
            v = flat.get(a.name)
            if isinstance(v, torch.Tensor) and a.alias_info is not None and a.alias_info.is_write:
                written.append(v)
        for r, v in zip(schema.returns, out if isinstance(out, tuple) else (out,)):
            view = r.alias_info is not None and not r.alias_info.is_write
            if isinstance(v, torch.Tensor) and not (factory or view):
                written.append(v)
        for v in written:
            if v.untyped_storage().nbytes():
                self.log.append(("write", v.untyped_storage().data_ptr(), str(func)))
        return out


def test_the_copy_out_waits_on_an_event_recorded_after_every_write_to_its_source():
    """Issue 19, item 4. The CUDA sanitizer reported a race: the offload built its byte view of
    the saved storage with ``set_`` (a write, to the sanitizer) on the compute stream *after* the
    ready event the copy stream waits on was recorded at save time, so the copy's read was not
    ordered after that write. Here the compute stream is logged as the sanitizer sees it: writes
    to each storage, the ready events recorded on it, and the copies with the event each waits
    on. Every write to a copied storage must come before the event its copy waits on."""
    from chameleon_swap.runtime.records import Handle

    class FakeEvent:
        pass

    log = []
    copy = make_copy_engine(torch.device("cpu"))
    real_offload = copy.offload

    def record_ready():
        ev = FakeEvent()
        log.append(("record", ev))
        return ev

    def offload(src, dst, ready):
        log.append(("copy", src.untyped_storage().data_ptr(), ready))
        return real_offload(src, dst, None)

    copy.record_ready, copy.offload = record_ready, offload
    ex = Executor(torch.device("cpu"), copy, HostPool(2**20, pin=False), min_tensor_bytes=0)

    class NoPolicy:
        def make_room(self, rec): pass
        def after_save(self, rec): pass

    class NoProfiler:
        def on_save(self, t, new, nbytes=0): return None

    ex.policy, ex.profiler = NoPolicy(), NoProfiler()
    try:
        ex.begin_step(1 << 30)
        saved = []
        with _StreamLog(log):
            for dtype in (torch.float32, torch.int64, torch.bool, torch.uint8):
                t = torch.ones(3, 5, dtype=dtype)          # produced: written before the save
                t2 = t.t()                                   # a view of it, saved as well
                saved += [t, ex.pack(t), ex.pack(t2)]
            for h in saved[1::3]:
                ex.offload(h.rec)
        ex.end_step(False)
        for t, h, _ in zip(saved[0::3], saved[1::3], saved[2::3]):
            assert isinstance(h, Handle)
            assert torch.equal(h.rec.host.view(t.nbytes).view(t.dtype).view(3, 5), t)
    finally:
        copy.close()
    copies = [(i, e) for i, e in enumerate(log) if e[0] == "copy"]
    assert len(copies) == 4
    for at, (_, ptr, ready) in copies:
        recorded = [i for i, e in enumerate(log) if e[0] == "record" and e[1] is ready]
        assert len(recorded) == 1, "the copy waits on no event recorded on the compute stream"
        late = [e for e in log[recorded[0]:at] if e[0] == "write" and e[1] == ptr]
        assert not late, f"written on the compute stream after the copy's ready event: {late}"


def test_a_storage_saved_again_after_its_bytes_left_finds_its_record_and_is_not_kept_alive():
    """The dedup map holds a resident record's storage; once the bytes left (budget 0: copied
    out in the pack hook), the record is found by the storage's id, and nothing of the engine's
    keeps the device storage alive."""
    import gc
    import weakref

    import chameleon_swap as cs

    x = torch.randn(64, 64, requires_grad=True)
    a = x * 2
    (a.sin() + a.cos()).sum().backward()
    ref_grad = x.grad.clone()
    x.grad = None
    with cs.Chameleon(0, device="cpu", min_tensor_bytes=0) as eng:
        with eng.step():
            a = x * 2
            s = a.sin()                        # saves a: copied out at once (budget 0)
            ex = eng._ex
            rec = ex.record_of(a.untyped_storage())
            assert rec is not None and rec.state == "host"
            assert a.untyped_storage() not in ex._records       # not held strongly any more
            records = ex.next_index
            c = a.cos()                        # saves a again: the same record, no new one
            assert ex.record_of(a.untyped_storage()) is rec and ex.next_index == records
            storage = weakref.ref(a.untyped_storage())
            loss = (s + c).sum()
            del a, s, c
            gc.collect()
            assert storage() is None           # the engine kept no reference to its bytes
            loss.backward()
    assert torch.equal(x.grad, ref_grad)


def test_a_storage_saved_again_after_its_bytes_left_still_catches_an_in_place_write():
    """The handle made at the second save never held the bytes: its witness follows the
    version, and a write in place before backward raises autograd's error (LESSONS 11)."""
    import chameleon_swap as cs

    x = torch.randn(64, 64, requires_grad=True)
    with cs.Chameleon(0, device="cpu", min_tensor_bytes=0) as eng:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            with eng.step():
                a = x * 2
                s = a.sin()                    # copied out at once (budget 0); s stays alive,
                c = a.cos()                    # its graph unused. Saved again: bytes on the host
                with torch.no_grad():
                    a.add_(1)
                del a
                c.sum().backward()             # unpacks the second handle only
                del s



@pytest.mark.parametrize("view", [False, True], ids=["tensor", "view"])
def test_a_witness_holds_no_bytes_and_follows_the_saved_tensors_version(view):
    """A moved tensor's witness (``records._make_witness``, made with a bare ``set_()``, outside
    no_grad) must let go of the storage, keep the dtype and device, leave the version where it
    was, and see every later in-place write to the saved tensor or, for a view, to its base."""
    from chameleon_swap.runtime.records import WITNESSES, _make_witness

    if not WITNESSES:
        pytest.skip("this torch lacks the private API witnesses rest on")
    w = torch.randn(8, 6, requires_grad=True)
    base = (w * 2).relu()                  # an activation: a non-leaf that requires grad
    saved = base[2:5] if view else base
    before = saved._version
    witness = _make_witness(saved.detach())
    assert witness is not None
    assert witness.untyped_storage().nbytes() == 0 and witness.numel() == 0
    assert witness.dtype == saved.dtype and witness.device == saved.device
    assert witness._version == saved._version == before     # (set_ bumped it: put back)
    assert saved.shape == ((3, 6) if view else (8, 6))      # the saved tensor is untouched
    with torch.no_grad():
        base.add_(1)
    assert witness._version == saved._version == before + 1

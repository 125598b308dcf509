"""Saved-tensor hooks, storage records, view rebuild, version checks and residency accounting.

The executor is mechanism only: it tells the policy what was saved and what is needed, and carries
out the moves the policy asks for (``offload``, ``prefetch``). The single decision it makes itself
is the last line of defence of the budget: a new tensor that the policy could not make room for is
copied out synchronously before the pack hook returns, so it is never kept resident.

Vocabulary
* record: one device storage that at least one saved tensor lives in (dedup by storage *object*,
  held through a weak-keyed map; never by address, which is reused within a step: LESSONS 4, 5).
* handle: what autograd keeps for one saved tensor: its record and its own size, stride, storage
  offset and dtype, from which the view is rebuilt after the storage came back (LESSONS 4, 12).
* resident bytes: bytes of records the engine keeps on the device after its hook returned,
  including records whose copy-out is still in flight and copies back already issued. A tensor
  handed to autograd at unpack and not retained is in use by the running backward node, not saved.
"""
from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch

from .copy import CopyEngine
from .copy.host_pool import HostBuffer, HostPool

# Record states.
RESIDENT = "resident"      # on device only
OFFLOADING = "offloading"  # on device, copy to host in flight (still counted)
HOST = "host"              # on host only
FETCHING = "fetching"      # on host, copy back in flight (counted)
RESTORED = "restored"      # on device and host, both valid (counted)
RELEASED = "released"


class Record:
    __slots__ = ("index", "nbytes", "small", "state", "device", "host", "ready", "out_ticket",
                 "in_ticket", "handles", "live", "counted", "keep_on_device", "failed", "__weakref__")

    def __init__(self, index: int, nbytes: int, small: bool, device: Optional[torch.Tensor],
                 ready: object) -> None:
        self.index = index            # save order within the step (first save of this storage)
        self.nbytes = nbytes
        self.small = small            # under min_tensor_bytes: moved only if the budget demands
        self.state = RESIDENT
        self.device = device          # uint8 tensor over the whole device storage, or None
        self.host: Optional[HostBuffer] = None
        self.ready = ready            # copy engine's "bytes are final" marker from save time
        self.out_ticket = None
        self.in_ticket = None
        self.handles: list = []       # weak references to this record's Handles
        self.live = 0                 # Handles alive
        self.counted = False          # bytes included in resident_bytes
        self.keep_on_device = False   # unpacked while its copy-out was in flight: keep it
        self.failed: Optional[str] = None


class Handle:
    """Autograd's stand-in for one saved tensor."""

    __slots__ = ("ex", "rec", "tensor", "tref", "size", "stride", "offset", "dtype", "version",
                 "conj", "neg", "dirty", "__weakref__")

    def __init__(self, ex: "Executor", rec: Optional[Record], t: torch.Tensor) -> None:
        self.ex = ex
        self.rec = rec
        # A detached alias of the original while it is on the device: same storage, same version
        # counter, but no autograd metadata. Holding the original would make a reference cycle
        # for saved *outputs* (node -> handle -> output -> grad_fn = node) that Python's gc cannot
        # see through C++, so a graph dropped without backward would never be freed.
        self.tensor: Optional[torch.Tensor] = t.detach()
        self.tref = weakref.ref(t)                # to check its version after we let go of it
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.dtype = t.dtype
        self.version = t._version
        self.conj = t.is_conj()
        self.neg = t.is_neg()
        self.dirty: Optional[int] = None          # version seen when found modified in place

    def rebuild(self, device: torch.Tensor) -> torch.Tensor:
        v = torch.empty(0, dtype=self.dtype, device=device.device).set_(
            device.untyped_storage(), self.offset, self.size, self.stride)
        if self.neg:
            v = torch._neg_view(v)
        if self.conj:
            v = v.conj()
        return v

    def __del__(self) -> None:
        rec = self.rec
        if rec is not None:
            try:
                self.ex._handle_gone(rec)
            except Exception:  # interpreter shutdown: nothing left to account for
                pass


class StepCounters:
    __slots__ = ("saved_bytes", "skipped_bytes", "foreign_bytes", "offloaded_bytes", "offloaded_tensors",
                 "prefetched_bytes", "fetched_bytes", "sync_fetches", "late_prefetches",
                 "budget_waits", "peak_resident_bytes")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)


def _version_error(h: Handle, now: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{h.dtype} {list(h.size)}] is at version {now}; expected version "
        f"{h.version} instead. (Detected by chameleon-swap, which checks the version that autograd "
        "cannot check for hooked saved tensors.)")


class Executor:
    def __init__(self, device: torch.device, copy: CopyEngine, pool: HostPool,
                 min_tensor_bytes: int) -> None:
        self.device = device
        self.copy = copy
        self.pool = pool
        self.min_tensor_bytes = min_tensor_bytes
        self.policy = None                       # set by the engine
        self.budget: Optional[int] = None        # this step's budget in bytes
        self.lock = threading.RLock()
        self._records: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._protected: "weakref.WeakSet" = weakref.WeakSet()   # buffer storages seen this step
        self.live: set[Record] = set()           # records with live handles (any step)
        self.resident_bytes = 0
        self.inflight_out_bytes = 0              # counted bytes whose copy-out is in flight
        self.moves = 0                           # records sent towards host so far (any step)
        self.next_index = 0
        self.stats = StepCounters()
        self.in_step = False

    # ------------------------------------------------------------------ step boundaries
    def begin_step(self, budget: Optional[int]) -> None:
        with self.lock:
            self.budget = budget
            self.next_index = 0
            self.stats = StepCounters()
            self.stats.peak_resident_bytes = self.resident_bytes
            self.in_step = True

    def end_step(self, failed: bool) -> StepCounters:
        with self.lock:
            self.in_step = False
            if failed:
                self.release_all("its step ended with an exception")
            self.copy.synchronize()
            self._protected = weakref.WeakSet()
            return self.stats

    def release_all(self, why: str) -> None:
        with self.lock:
            for rec in list(self.live):
                rec.failed = f"this saved tensor was released because {why}"
                self._release(rec)

    # ------------------------------------------------------------------ classification
    def protect_buffers(self, module: torch.nn.Module) -> None:
        for b in module._buffers.values():
            if b is not None:
                self._protected.add(b.untyped_storage())

    def _is_state(self, t: torch.Tensor) -> bool:
        """Parameters, user leaves that require grad, buffers and views of any of these: they stay
        on the device whatever we do, so moving them would cost bandwidth and free nothing."""
        base = t if t._base is None else t._base
        if isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad):
            return True
        return len(self._protected) > 0 and t.untyped_storage() in self._protected

    # ------------------------------------------------------------------ pack
    def pack(self, t: torch.Tensor):
        if (type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter) \
                or t.device != self.device or t.layout != torch.strided:
            # Another device, a tensor subclass (DTensor, ...) or a sparse layout: left as is.
            self.stats.foreign_bytes += t.nbytes if t.layout == torch.strided else 0
            return Handle(self, None, t)
        with self.lock:
            if self._is_state(t):
                self.stats.skipped_bytes += t.untyped_storage().nbytes()
                return Handle(self, None, t)
            self.copy.poll()
            storage = t.untyped_storage()
            rec = self._records.get(storage)
            if rec is not None and rec.state != RELEASED:
                h = Handle(self, rec, t)
                self._attach(rec, h)
                return h
            nbytes = storage.nbytes()
            raw = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
            rec = Record(self.next_index, nbytes, nbytes < self.min_tensor_bytes, raw,
                         self.copy.record_ready())
            self.next_index += 1
            self.stats.saved_bytes += nbytes
            self._records[storage] = rec
            self.live.add(rec)
            h = Handle(self, rec, t)
            self._attach(rec, h)
            if self.budget is not None and nbytes > 0:
                self.policy.make_room(rec)
                if self.resident_bytes + nbytes > self.budget:
                    # The policy could not make room: keep the promise by copying it out now.
                    self.offload(rec)
                    self.wait_offload(rec)
                    return h
            self._count(rec)
            self.policy.after_save(rec)
            return h

    def _attach(self, rec: Record, h: Handle) -> None:
        rec.handles.append(weakref.ref(h))
        rec.live += 1
        if rec.state != RESIDENT:
            # Saved again after its bytes left (the storage is alive elsewhere): use the copy.
            h.tensor = None

    def _count(self, rec: Record) -> None:
        if not rec.counted:
            rec.counted = True
            self.resident_bytes += rec.nbytes
            if self.resident_bytes > self.stats.peak_resident_bytes:
                self.stats.peak_resident_bytes = self.resident_bytes

    def _uncount(self, rec: Record) -> None:
        if rec.counted:
            rec.counted = False
            self.resident_bytes -= rec.nbytes
            if rec.state == OFFLOADING:
                self.inflight_out_bytes -= rec.nbytes

    # ------------------------------------------------------------------ moves (asked by policies)
    def offload(self, rec: Record) -> None:
        """Start copying a resident record to host; it stays counted until the copy completes."""
        assert rec.state == RESIDENT, rec.state
        self._check_versions(rec)
        rec.host = self.pool.acquire(rec.nbytes)
        rec.out_ticket = self.copy.offload(rec.device, rec.host.view(rec.nbytes), rec.ready)
        rec.ready = None
        rec.state = OFFLOADING
        self.moves += 1
        if rec.counted:
            self.inflight_out_bytes += rec.nbytes
        # Keep the original tensors until the copy is done so a late in-place write is caught.
        keep = []
        for ref in rec.handles:
            h = ref()
            if h is not None and h.tensor is not None:
                keep.append(h.tensor)
                h.tensor = None
        self.stats.offloaded_bytes += rec.nbytes
        self.stats.offloaded_tensors += 1
        self.copy.defer(rec.out_ticket, lambda: self._offloaded(rec, keep))

    def _offloaded(self, rec: Record, keep: list) -> None:
        if rec.state != OFFLOADING:
            return
        for t in keep:
            self._check_tensor(rec, t)
        if rec.counted:
            self.inflight_out_bytes -= rec.nbytes
        if rec.keep_on_device:
            rec.state = RESTORED
        else:
            rec.device = None
            rec.state = HOST
            self._uncount(rec)

    def wait_offload(self, rec: Record) -> None:
        """Block the host until ``rec``'s copy-out has completed: only when the budget forces it."""
        self.stats.budget_waits += 1
        self.copy.wait_host(rec.out_ticket)
        self.copy.poll()

    def prefetch(self, rec: Record) -> None:
        """Start copying a host record back; it counts as resident from now on."""
        assert rec.state == HOST, rec.state
        self._fetch(rec)
        self.stats.prefetched_bytes += rec.nbytes
        self._count(rec)

    def _fetch(self, rec: Record) -> None:
        rec.device, rec.in_ticket = self.copy.fetch(rec.host.view(rec.nbytes), rec.out_ticket)
        rec.state = FETCHING

    def drop_device_copy(self, rec: Record) -> None:
        """Forget the device copy of a restored record whose host copy is still valid: room
        without any copy."""
        assert rec.state == RESTORED and rec.host is not None, rec.state
        self._check_versions(rec)
        rec.device = None
        rec.keep_on_device = False
        rec.state = HOST
        self.moves += 1
        self._uncount(rec)

    def backward_trigger(self, grad=None) -> None:
        """A module's backward is about to start (hook on its output's gradient)."""
        with self.lock:
            self.copy.poll()
            self.policy.on_backward_trigger()

    # ------------------------------------------------------------------ unpack
    def unpack(self, h: Handle) -> torch.Tensor:
        rec = h.rec
        if rec is None:
            if h.tensor._version != h.version:
                raise _version_error(h, h.tensor._version)
            return h.tensor
        with self.lock:
            if rec.failed:
                raise RuntimeError(f"chameleon-swap: {rec.failed}")
            self.copy.poll()
            t = h.tref()
            if t is not None and t._version != h.version:
                raise _version_error(h, t._version)
            if h.dirty is not None:
                raise _version_error(h, h.dirty)
            if rec.state == OFFLOADING:
                rec.keep_on_device = True                # needed already: keep the device copy
            elif rec.state == HOST:
                self.stats.sync_fetches += 1
                self.stats.fetched_bytes += rec.nbytes
                self._fetch(rec)
                if self.budget is None or self.policy.make_room_backward(rec):
                    self._count(rec)
            # Issue the next copies back before waiting on this one, so they overlap.
            self.policy.on_unpack(rec)
            if h.tensor is not None:                     # never left the device
                return h.tensor
            device = rec.device
            if rec.state == FETCHING:
                if self.copy.wait(rec.in_ticket) and rec.counted:
                    self.stats.late_prefetches += 1     # prefetched, but not early enough
                    self.stats.sync_fetches += 1
                rec.state = RESTORED
                if not rec.counted:
                    # Fetched with no room to keep it: it lives as long as autograd uses it.
                    rec.device = None
                    rec.state = HOST
            return h.rebuild(device)

    # ------------------------------------------------------------------ release
    def _handle_gone(self, rec: Record) -> None:
        with self.lock:
            rec.live -= 1
            if rec.live == 0 and rec.state != RELEASED:
                self._release(rec)

    def _release(self, rec: Record) -> None:
        self._uncount(rec)
        prev = rec.state
        rec.state = RELEASED
        self.live.discard(rec)
        for ref in rec.handles:
            h = ref()
            if h is not None:
                h.tensor = None
        host = rec.host
        if prev == FETCHING and not rec.in_ticket.done():
            self.copy.defer(rec.in_ticket, keep=rec.device)   # copy back still writing into it
        rec.host = None
        rec.device = None
        rec.ready = None
        if host is not None:
            # The host buffer goes back to the pool only once no copy reads or writes it.
            last = rec.in_ticket if prev in (FETCHING, RESTORED) and rec.in_ticket else rec.out_ticket
            if last is None or last.done():
                self.pool.release(host)
            else:
                self.copy.defer(last, lambda: self.pool.release(host))

    # ------------------------------------------------------------------ version checks
    def _check_versions(self, rec: Record) -> None:
        for ref in rec.handles:
            h = ref()
            if h is not None:
                t = h.tensor if h.tensor is not None else h.tref()
                if t is not None and t._version != h.version:
                    h.dirty = t._version

    def _check_tensor(self, rec: Record, t: torch.Tensor) -> None:
        for ref in rec.handles:
            h = ref()
            if h is not None and h.tref() is t and t._version != h.version:
                h.dirty = t._version

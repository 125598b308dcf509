"""Saved-tensor hooks, storage records, view rebuild, version checks and residency accounting.

The executor is mechanism only: it tells the policy what was saved and what is needed, and carries
out the moves the policy asks for (``offload``, ``prefetch``). The single decision it makes itself
is the last line of defence of the budget: a new tensor that the policy could not make room for is
copied out synchronously before the pack hook returns, so it is never kept resident.

Vocabulary (the classes are in ``records.py``)
* record: one device storage that at least one saved tensor lives in (dedup by storage *object*,
  never by address, which is reused within a step: LESSONS 4, 5; the map holds the storage only
  while its bytes are on the device).
* handle: what autograd keeps for one saved tensor: its record and its own size, stride, storage
  offset and dtype, from which the view is rebuilt after the storage came back (LESSONS 4, 12).
* resident bytes: bytes of records the engine keeps on the device after its hook returned,
  including records whose copy-out is still in flight and copies back already issued. A tensor
  handed to autograd at unpack and not retained is in use by the running backward node, not saved.

Why one file (over 400 lines): a record's states (resident, offloading, offloaded, fetching,
restored) change from pack, unpack, the policy's moves and the step's end, and every change must
keep the resident count, the deferred frees and the version checks true together. Kept in one
class, the invariants read in one place; split, each transition would reach into another module's
books.
"""
from __future__ import annotations

import threading
import weakref
from collections import deque
from time import perf_counter
from typing import Callable, Optional

import torch

from . import interrupts
from ..copy import CopyEngine
from ..copy.host_pool import HostPool
# The books (records, handles, counters); the states and Record are imported from here too.
from .records import (FETCHING, HOST, OFFLOADING, RELEASED, RESIDENT, RESTORED,  # noqa: F401
                      UNMARKED, Handle, Record, StepCounters, _make_witness, _Need,
                      _version_error)

_Tensor, _Parameter, _STRIDED = torch.Tensor, torch.nn.Parameter, torch.strided


MAIN_THREAD = threading.main_thread().ident


class Executor:
    def __init__(self, device: torch.device, copy: CopyEngine, pool: HostPool,
                 min_tensor_bytes: int, resident_only: bool = False) -> None:
        self.device = device
        self._cpu = device.type == "cpu"
        # The lean path (resident.py): saves kept where autograd put them, as an engine that never
        # moves keeps them; always on such an engine, and on one with a budget from the moment
        # the engine finds the step to be a size its budget holds whole (``lean_limit``: the
        # budget; a save that would pass it ends the lean path for the rest of the step, and
        # ``on_trip`` is called). The lean path's records have no handles and never move.
        self.resident_only = resident_only
        self.lean = resident_only
        self.lean_limit: Optional[int] = None
        self.on_trip: Optional[Callable[[], None]] = None
        self.lean_again: Optional[Callable] = None      # (t, record) -> a lean save of it
        self.on_first: Optional[Callable] = None        # (t): the step's first new record's
        self.copy = copy
        self.pool = pool
        self.min_tensor_bytes = min_tensor_bytes
        self.policy = None                       # set by the engine
        self._profiler = None                    # set by the engine (sees every save and use)
        self._now: Callable[[], float] = perf_counter    # (the profiler's clock, once set)
        self._on_move: Optional[Callable] = None
        self._in_wait = False                    # inside a budget wait (see _moved)
        self.budget: Optional[int] = None        # this step's budget in bytes
        self.lock = threading.RLock()
        # Storage object -> record, for the records whose device bytes are still ours: a plain
        # dict holding the storage (as the handles' aliases do anyway), popped when the record
        # is released or its device bytes go (``_bytes_left``). A record whose bytes left must
        # not keep its device storage alive, so from then on it is found by the storage's id,
        # checked through a weak reference (``_moved_records``: id -> (weakref, record)), and
        # only where any moved. A WeakKeyDictionary, used before, costs Python calls and a weak
        # reference per lookup, at every save: 4% of the Python calls of a step of the
        # emulated-link benchmark's Llama (165 saves) with nothing to move.
        self._records: dict = {}
        self._moved_records: dict = {}
        self._protected: dict = {}               # buffer storages seen this step: id -> weakref
        self._any_protected = False
        self.live: set[Record] = set()           # records with live handles (any step)
        self.resident_bytes = 0
        self.inflight_out_bytes = 0              # counted bytes whose copy-out is in flight
        self.recompute_reserve = 0               # room kept for the recomputes still to come
        self.moves = 0                           # records sent towards host so far (any step)
        self.next_index = 0
        self.stats = StepCounters()
        self.in_step = False
        self._holds: dict[int, int] = {}         # hold token -> bytes (see hold())
        self._next_hold = 0
        self._earlier: set = set()               # records alive when this step began
        self._settled_moves = 0                  # self.moves at the last settle()
        self.recount = False                     # one escaped a release: recount at settle()
        self.recount_lean = None                 # resident.py's recount of its handle-less records
        # Copy-outs the budget did not need yet, put off while no host buffer was ready (see
        # offload), oldest first; and those of them started later, whose bytes the budget waits on.
        self._deferred: deque = deque()
        self._deferred_out: deque = deque()
        self._optional = False                   # in after_save: copy-outs the budget can spare
        interrupts.watch(self)

    # ------------------------------------------------------------------ step boundaries
    def begin_step(self, budget: Optional[int]) -> None:
        """Call settle() first (the engine does): it finishes what an interrupt cut short."""
        with self.lock:
            # Records alive now belong to graphs of earlier steps that the caller still holds:
            # a failure of this step must leave them alone.
            self._earlier = set(self.live)
            self.budget = budget
            self.recompute_reserve = 0
            self._deferred.clear()
            self._deferred_out.clear()
            self._optional = False
            self.next_index = 0
            self.stats = StepCounters()
            self.stats.peak_resident_bytes = self.resident_bytes
            self.lean = self.resident_only
            self.lean_limit = None
            self.in_step = True

    def end_step(self, failed: bool) -> StepCounters:
        with self.lock:
            if failed:
                self._release_step("its step ended with an exception")
            self.in_step = False
            self._deferred.clear()           # still resident: backward uses them in place
            self._deferred_out.clear()
            if self.budget is not None:      # with none, the copy engine was never used
                self.copy.synchronize()
            self._protected = {}
            self._any_protected = False
            return self.stats

    def _release_step(self, why: str) -> None:
        """Release what this step saved; records of earlier steps' graphs stay valid."""
        for rec in [r for r in self.live if r not in self._earlier]:
            rec.failed = f"this saved tensor was released because {why}"
            self._release(rec)

    def release_all(self, why: str) -> None:
        with self.lock:
            for rec in list(self.live):
                rec.failed = f"this saved tensor was released because {why}"
                self._release(rec)

    def settle(self) -> None:
        """Between steps: finish whatever an asynchronous exception (a Ctrl-C) cut short, so that
        no record, byte count or host buffer is lost to it. Python can raise KeyboardInterrupt
        between any two bytecodes, including inside ``Handle.__del__`` (where it is swallowed)
        and inside a release, so the incremental bookkeeping cannot be trusted to be whole after
        one. Here it is made whole again from the records themselves: a step whose end never
        ran releases what it saved; a record whose handles are all gone is released; the
        residency counters are recomputed; host buffers that no record holds go back to the
        arena. Every part is idempotent, and cheap when nothing is alive (the usual case)."""
        with self.lock:
            if self.in_step:
                self.end_step(True)          # its end never ran: release what it saved
            if self.recount:
                self.recount = False
                if self.recount_lean is not None:
                    self.recount_lean(self)
            for rec in list(self.live):
                # Records of the resident-only hooks (resident.py) have no Handles: their
                # saved tuples keep ``live`` themselves.
                gone = (not any(r() is not None for r in rec.handles) if rec.handles
                        else rec.live <= 0)
                if rec.state == RELEASED or gone:
                    self._release(rec)
            counted = [r for r in self.live if r.counted]
            self.resident_bytes = sum(r.nbytes for r in counted) + sum(self._holds.values())
            self.inflight_out_bytes = sum(r.nbytes for r in counted if r.state == OFFLOADING)
            # Host buffers exist only where something moved (never with no budget).
            if self.budget is not None or self.moves != self._settled_moves:
                self.copy.synchronize()      # deferred frees run: nothing is in flight now
                self.pool.settle([r.host for r in self.live if r.host is not None])
            self._settled_moves = self.moves
            # A storage that outlives its step (an input the caller keeps) would keep its
            # released record in the dedup map, and with it the record's tickets, for as long as
            # it lives: forget released records.
            for storage, rec in list(self._records.items()):
                if rec.state == RELEASED:
                    self._records.pop(storage, None)
            for key, (ref, rec) in list(self._moved_records.items()):
                if rec.state == RELEASED or ref() is None:
                    self._moved_records.pop(key, None)

    def record_of(self, storage) -> Optional[Record]:
        """The record of a storage object, released or not (None if it has none)."""
        rec = self._records.get(storage)
        return rec if rec is not None else self._moved_record(storage)

    def _moved_record(self, storage) -> Optional[Record]:
        entry = self._moved_records.get(id(storage))
        return entry[1] if entry is not None and entry[0]() is storage else None

    def release_holds(self) -> None:
        """Stop counting every hold (between steps, when whoever held can no longer release)."""
        with self.lock:
            for token in list(self._holds):
                self.release_hold(token)

    # ------------------------------------------------------------------ classification
    def protect_buffers(self, module: torch.nn.Module) -> None:
        protected = self._protected
        for b in module._buffers.values():
            if b is not None:
                s = b.untyped_storage()
                ref = protected.get(id(s))
                if ref is None or ref() is not s:
                    # By id, checked through a weak reference: a WeakSet's membership test is
                    # Python code that makes a weak reference per test, once per saved tensor.
                    protected[id(s)] = weakref.ref(s)
                self._any_protected = True

    def _is_protected(self, storage) -> bool:
        ref = self._protected.get(id(storage))
        return ref is not None and ref() is storage

    # ------------------------------------------------------------------ pack
    def pack(self, t: torch.Tensor):
        # The hottest path of a step with a budget: once per saved tensor, between operators that
        # leave the host's caches cold, so every Python step counts several times what it does in
        # a loop (issue 22: the demo's Llama with every block kept, nothing moved, ran 1.35x its
        # plain step, the resident-only hooks 1.09x). Checks inlined, locals over attributes.
        tt = type(t)
        if (tt is not _Tensor and tt is not _Parameter) or t.layout is not _STRIDED \
                or (not t.is_cpu if self._cpu else t.device != self.device):
            # Another device, a tensor subclass (DTensor, ...) or a sparse layout: left as is.
            self.stats.foreign_bytes += t.nbytes if t.layout == _STRIDED else 0
            return Handle(self, None, t)
        profiler = self.profiler
        with self.lock:
            # Parameters, user leaves that require grad, buffers and views of any of these stay on
            # the device whatever we do: moving them would cost bandwidth and free nothing.
            # Parameters are leaves: is_leaf first spares activations the Python-level isinstance
            # check of Parameter's metaclass.
            base = t._base
            if base is None:
                base = t
            if (base.is_leaf and (base.requires_grad or isinstance(base, _Parameter))) or (
                    self._any_protected and self._is_protected(t.untyped_storage())):
                self.stats.skipped_bytes += t.untyped_storage().nbytes()
                profiler.on_save(t, False)
                return Handle(self, None, t)
            budget = self.budget
            if budget is not None:           # with none, no copy is ever in flight to poll
                self.copy.poll()
            storage = t.untyped_storage()
            rec = self._records.get(storage)
            if rec is None and self._moved_records:
                rec = self._moved_record(storage)
            if rec is not None and rec.state != RELEASED:
                if not rec.handles:          # saved on the lean path: so again (resident.py)
                    return self.lean_again(t, rec)
                profiler.on_save(t, False)
                h = Handle(self, rec, t)
                self._attach(rec, h)
                return h
            nbytes = storage.nbytes()
            # With no budget nothing can move this step (policies move only records saved in the
            # step under way), so no "bytes are final" marker is taken: on CUDA it is an event
            # and a stream lookup per save. With a budget the marker is taken here, at save time,
            # on the stream current now: a marker recorded later, at the copy, would not order
            # the copy after a producer that ran on another stream (LESSONS 3).
            rec = Record(self.next_index, nbytes, nbytes < self.min_tensor_bytes, None,
                         UNMARKED if budget is None else self.copy.record_ready())
            self.next_index += 1
            rec.key = profiler.on_save(t, True, nbytes)
            if rec.index == 0 and self.on_first is not None:
                self.on_first(t)
            stats = self.stats
            stats.saved_bytes += nbytes
            rec.storage = storage
            self._records[storage] = rec
            self.live.add(rec)
            h = Handle(self, rec, t)
            rec.handles.append(weakref.ref(h))    # _attach, for a record known to be resident
            rec.live = 1
            policy = self.policy
            if budget is not None and nbytes > 0:
                if self._deferred:
                    self._move_deferred(nbytes)
                policy.make_room(rec)
                if self._deferred_out:
                    self._wait_deferred(budget - self.recompute_reserve - nbytes)
                if self.resident_bytes + nbytes > budget:
                    # The policy could not make room: keep the promise by copying it out now.
                    stats.forced_offloads += 1
                    self.offload(rec)
                    self.wait_offload(rec)
                    return h
            self._count(rec)
            # Within the budget with this save: what the policy moves now can wait (offload).
            self._optional = True
            try:
                policy.after_save(rec)
            finally:
                self._optional = False
            return h

    def _attach(self, rec: Record, h: Handle) -> None:
        rec.handles.append(weakref.ref(h))
        rec.live += 1
        if rec.state != RESIDENT:
            # Saved again after its bytes left (the storage is alive elsewhere): use the copy,
            # and follow the version through a witness, as for the handles that saw them leave.
            h.keep_geometry()
            h.witness = _make_witness(h.tensor)
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
    def offload(self, rec: Record) -> bool:
        """Start copying a resident record to host; it stays counted until the copy completes.

        A copy-out a policy asks for in ``after_save`` (resident bytes are within the budget
        with this save) is not needed yet. If no host buffer is ready for it
        (``HostPool.ready``), starting it would wait for host memory to be allocated: it is put
        off instead (False; ``host_deferred_moves``), the record stays resident and counted,
        and it is moved at a later save, once a buffer is ready or the budget needs its bytes
        (``_move_deferred``; waiting is allowed then). A step that would have waited moves less
        and does not stall (issue 19)."""
        assert rec.state == RESIDENT, rec.state
        if not rec.handles:
            return False         # saved on the lean path: autograd holds its storage itself
        if self._optional and not self.pool.ready(rec.nbytes):
            if rec not in self._deferred:
                self._deferred.append(rec)
                self.stats.host_deferred_moves += 1
            return False
        t0 = self._now()
        if rec.ready is UNMARKED:
            raise RuntimeError(f"chameleon-swap: internal error: record {rec.index} was saved in a "
                               "step with no budget (no ready marker) and cannot be moved")
        self._check_versions(rec)
        rec.device = self._device_bytes(rec)
        rec.host, blocked = self._host_buffer(rec.nbytes)
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
                h.keep_geometry()
                keep.append((h, h.tensor))
                h.witness = h.tensor      # versions stay visible while the copy is in flight
                h.tensor = None
        self.stats.offloaded_bytes += rec.nbytes
        self.stats.offloaded_tensors += 1
        self.copy.defer(rec.out_ticket, lambda: self._offloaded(rec, keep))
        self._moved(t0 + blocked, True)
        return True

    def _host_buffer(self, nbytes: int):
        """A host buffer for a copy-out, and the seconds this thread was blocked getting it.
        An arena growing on this thread (pinning, on CUDA) is a wait, not compute nor a move:
        the copy engine counts it among the step's waits (``host_block``), so a step that grew
        its arena plans like one that did not."""
        if not self.pool.would_block(nbytes):
            return self.pool.acquire(nbytes), 0.0
        t0 = self._now()
        with self.copy.host_block():
            buf = self.pool.acquire(nbytes)
        return buf, self._now() - t0

    def _move_deferred(self, nbytes: int) -> None:
        """Start the copy-outs put off earlier (``offload``), oldest first: those the budget
        needs to make room for ``nbytes`` more, waiting for host memory if it must, then, in
        forward, any whose host buffer is ready now. Called at a save (or hold), before the
        policy makes room."""
        target = self.budget - self.recompute_reserve - nbytes
        forward = self.profiler is None or not self.profiler.used
        queue = self._deferred
        while queue:
            rec = queue[0]
            if rec.state != RESIDENT or not rec.counted or rec.used:
                queue.popleft()                # released, moved, or needed by backward already
                continue
            if self.resident_bytes - self.inflight_out_bytes <= target and \
                    not (forward and self.pool.ready(rec.nbytes)):
                return
            queue.popleft()
            self.offload(rec)
            self._deferred_out.append(rec)

    def _wait_deferred(self, target: int) -> None:
        """Wait for the put-off copy-outs started for room (oldest first) until the resident
        bytes are at most ``target``: the policy's own waits do not know of them."""
        while self.resident_bytes > target and self._deferred_out:
            rec = self._deferred_out.popleft()
            if rec.state == OFFLOADING and not rec.out_ticket.done():
                self.wait_offload(rec)

    @property
    def profiler(self):
        return self._profiler

    @profiler.setter
    def profiler(self, profiler) -> None:
        # Its clock and its move callback are bound once here, not looked up at each of the
        # three or four times a move is timed (the tests' stand-ins may lack either).
        self._profiler = profiler
        self._now = getattr(profiler, "now", None) or perf_counter
        self._on_move = getattr(profiler, "on_move", None)

    def _moved(self, t0: float, new: bool = False) -> None:
        """Host time since ``t0`` (``_now()``) went to moving a tensor: the profiler keeps it
        apart from compute."""
        on_move = self._on_move
        if on_move is not None and not self._in_wait:
            on_move(self._now() - t0, new)

    @staticmethod
    def _device_bytes(rec: Record) -> torch.Tensor:
        """The record's whole device storage as one flat uint8 tensor, built at its first move
        rather than at save: most records never move, and building it costs about as much as
        the rest of a pack. A resident record's storage is held by its live handles."""
        alive = [h.tensor for h in (ref() for ref in rec.handles)
                 if h is not None and h.tensor is not None]
        for t in alive:
            flat = byte_view(t)
            if flat is not None:
                return flat
        if alive:
            # No view of it can span the storage (see byte_view): ``set_``, which the CUDA
            # sanitizer counts as a write on the compute stream.
            return torch.empty(0, dtype=torch.uint8, device=alive[0].device).set_(
                alive[0].untyped_storage())
        raise RuntimeError(f"chameleon-swap: internal error: resident record {rec.index} has no "
                           "live handle on the device")

    def _offloaded(self, rec: Record, keep: list) -> None:
        if rec.state != OFFLOADING:
            return
        t0 = self._now()
        for h, t in keep:
            if t._version != h.version and h.dirty is None:
                h.dirty = t._version      # written while its copy was in flight
            h.witness = _make_witness(t)
        if rec.counted:
            self.inflight_out_bytes -= rec.nbytes
        if rec.keep_on_device:
            rec.state = RESTORED
        else:
            rec.device = None
            rec.state = HOST
            self._uncount(rec)
            self._bytes_left(rec)
        self._moved(t0)

    def _bytes_left(self, rec: Record) -> None:
        """``rec``'s device bytes are no longer ours: its storage is found through the weak map
        from now on, which lets the storage go when nothing else holds it."""
        storage = rec.storage
        if storage is not None:
            rec.storage = None
            if self._records.get(storage) is rec:
                del self._records[storage]
                self._moved_records[id(storage)] = (weakref.ref(storage), rec)

    def wait_offload(self, rec: Record) -> None:
        """Block the host until ``rec``'s copy-out has completed: only when the budget forces it."""
        self.stats.budget_waits += 1
        self._in_wait = True            # completions handled inside count as the wait's time
        try:
            self.copy.wait_host(rec.out_ticket)         # and handles what completed
        finally:
            self._in_wait = False

    def prefetch(self, rec: Record) -> None:
        """Start copying a host record back; it counts as resident from now on."""
        assert rec.state == HOST, rec.state
        self._fetch(rec)
        self.stats.prefetched_bytes += rec.nbytes
        self._count(rec)

    def _fetch(self, rec: Record) -> None:
        t0 = self._now()
        rec.device, rec.in_ticket = self.copy.fetch(rec.host.view(rec.nbytes), rec.out_ticket)
        rec.state = FETCHING
        self._moved(t0)

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
        self._bytes_left(rec)

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
            if self.budget is not None:
                self.copy.poll()
            now = h.current_version()
            if now is not None and now != h.version:
                raise _version_error(h, now)
            if h.dirty is not None:
                raise _version_error(h, h.dirty)
            budgeted = self.budget is not None
            if not rec.used:
                rec.used = True
                self.profiler.on_first_use(rec.index)
                if budgeted:
                    self.policy.on_first_use(rec)
            if not budgeted and h.tensor is not None:
                return h.tensor          # nothing moves without a budget: nothing to bring back
            if rec.state == OFFLOADING:
                if not rec.keep_on_device:
                    self.stats.kept_bytes += rec.nbytes
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
            t0 = self._now()
            out = h.rebuild(device)
            self._moved(t0)
            return out

    # ------------------------------------------------------------------ release
    def _handle_gone(self, rec: Record) -> None:
        if threading.get_ident() == MAIN_THREAD:
            # The only thread a Ctrl-C lands on: ``with`` cannot lose the lock to one.
            with self.lock:
                self._drop_handle(rec)
            return
        # A handle can die on any thread: cyclic garbage is collected by whichever thread
        # allocates next, a copy worker or the host arena's reserve thread included. Their
        # callers wait for them while holding this lock (wait_offload, an acquire waiting for
        # the reserve), so waiting for the lock here would deadlock. Held elsewhere, the record
        # is left as it is: settle() releases records whose handles are all gone at the next
        # step boundary (until then its bytes stay counted, which errs on the budget's side).
        if not self.lock.acquire(blocking=False):
            return
        try:
            self._drop_handle(rec)
        finally:
            self.lock.release()

    def _drop_handle(self, rec: Record) -> None:
        rec.live -= 1
        if rec.live == 0 and rec.state != RELEASED:
            self._release(rec)

    def _release(self, rec: Record) -> None:
        self._uncount(rec)
        prev = rec.state
        rec.state = RELEASED
        self.live.discard(rec)
        if rec.storage is not None:
            if self._records.get(rec.storage) is rec:
                del self._records[rec.storage]
            rec.storage = None
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
        # A released record may live on (its storage is kept by the caller): hold nothing.
        rec.out_ticket = rec.in_ticket = None
        rec.handles = []

    # ------------------------------------------------------------------ version checks

    def _check_versions(self, rec: Record) -> None:
        for ref in rec.handles:
            h = ref()
            if h is not None:
                now = h.current_version()
                if now is not None and now != h.version:
                    h.dirty = now

    # ------------------------------------------------------------------ holds (recompute mechanism)
    def hold(self, nbytes: int) -> int:
        """Count ``nbytes`` of device memory as resident saved activations that the hooks cannot
        see (the outputs selective checkpointing keeps itself, a block's recompute working set).
        Held bytes are never moved; they stay counted until ``release_hold(token)``. ``end_step``
        leaves holds alone: whoever holds releases."""
        return self._hold(nbytes, False)

    def try_hold(self, nbytes: int) -> Optional[int]:
        """``hold``, where the budget has room for ``nbytes`` once what can move has moved;
        None (nothing held) where it has not. For bytes the holder can still choose not to keep
        (an output selective checkpointing would keep can be recomputed instead): a hold cannot
        be moved, so one past the budget would break it."""
        return self._hold(nbytes, True)

    def _hold(self, nbytes: int, only_if_room: bool) -> Optional[int]:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"nbytes must be an int (bytes to hold); got {type(nbytes).__name__}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0; got {nbytes}")
        with self.lock:
            if self.budget is not None and nbytes and self.policy is not None \
                    and self.resident_bytes + nbytes > self.budget:
                # Room as for a save: in forward the policy copies out; in backward it drops
                # device copies that are still valid on the host (no copy needed).
                need = _Need(nbytes)
                if self.profiler is None or not self.profiler.used:
                    if self._deferred:
                        self._move_deferred(nbytes)
                    self.policy.make_room(need)
                    if self._deferred_out:
                        self._wait_deferred(self.budget - self.recompute_reserve - nbytes)
                else:
                    self.policy.make_room_backward(need)
                if only_if_room and self.resident_bytes + nbytes > self.budget:
                    return None
            token = self._next_hold
            self._next_hold += 1
            self._holds[token] = nbytes
            self.resident_bytes += nbytes
            if self.resident_bytes > self.stats.peak_resident_bytes:
                self.stats.peak_resident_bytes = self.resident_bytes
            if self.profiler is not None:
                self.profiler.on_hold(sum(self._holds.values()))
            return token

    def release_hold(self, token: int) -> None:
        """Stop counting a hold; releasing a token again (or one never given) does nothing."""
        with self.lock:
            nbytes = self._holds.pop(token, None)
            if nbytes is not None:
                self.resident_bytes -= nbytes
                if self.profiler is not None:
                    self.profiler.on_hold(sum(self._holds.values()))

    @property
    def held_bytes(self) -> int:
        """Bytes of holds not released yet (included in ``resident_bytes``)."""
        with self.lock:
            return sum(self._holds.values())


def byte_view(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t``'s whole storage as one flat uint8 tensor, made by view ops only (``as_strided``,
    ``view(dtype)``), or None where no view can span it (a storage whose size is not a whole
    number of ``t``'s elements, a conjugate or negative view).

    Not ``torch.empty(0).set_(storage)``: ``set_`` marks its output as written, and the CUDA
    sanitizer (torch.cuda._sanitizer counts an op's output as written unless the schema says it
    is a view) then saw a write on the compute stream after the ready event that the copy
    stream waits on, and reported a data race with the copy's read (issue 19: found on an H100
    on two runs out of two). View ops are metadata only to it: no read, no write."""
    size = t.untyped_storage().nbytes()
    item = t.element_size()
    if size % item or t.is_conj() or t.is_neg():
        return None
    flat = t.detach().as_strided((size // item,), (1,), 0)   # no autograd node
    return flat if t.dtype == torch.uint8 else flat.view(torch.uint8)

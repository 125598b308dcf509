"""The lean saved-tensor hooks: of an engine that can never move anything, and of a lean step.

An engine with no budget, no ``device_memory_limit``, no ``model=`` and no ``trace_dir`` never
copies, plans or times anything: every saved tensor stays where autograd put it. Nor does a step
of an engine with a budget whose size the budget holds whole, from its first block on (with
``model=``) or its second saved storage (``policy/lean.py``; ``Executor.lean`` is on from then).
What is left to do per saved tensor is what ``StepStats`` and the profile report: dedup by
storage object (``saved_bytes``, ``peak_resident_bytes``, exact), parameters, leaves that
require grad and buffers skipped (``skipped_bytes``), the version check autograd cannot make for
hooked saved tensors (LESSONS 11), and the order of saves and first uses. These hooks do only
that, on the executor's own records and counters, in fewer Python steps than
``Executor.pack``/``unpack``:

* a saved tensor is a ``_Saved`` tuple (alias, version, record, release) whose ``__del__`` tells
  the executor, instead of a ``Handle`` (no geometry, weak references or witness: they serve
  moves); a parameter or buffer is a plain ``(alias, version)`` tuple (nothing to account for);
  a record saved so has no handles, and the executor never moves it (``Executor.offload``);
* the storage -> record map is the executor's own dict, popped when the record is released (a
  record's saved tuples hold its storage anyway; identity stays the object's, LESSONS 5);
* no policy call, no copy engine, no ready marker;
* the profiler gets one raw tuple per save, turned into event ids at the step's end
  (``Profiler.finish``) on an engine that never moves: no module events (it registers no module
  hooks but the buffer one), so keys and signatures are by save order alone. A lean step's
  profile keeps only the saves before its lean path began (``step_end``): on an engine with a
  budget its saves and first uses are not written down at all;
* the release is inlined, on an engine with a budget too: a lean record has no handles, no host
  buffer and no copy in flight, which is all the executor's own release adds (the emulated-link
  benchmark's HF Llama 256x8 at 384 tokens, 243 releases a step on this project's 2-core CPU:
  a median of 15.7 us each through the executor's, 11.1 us inlined, five runs each; a quarter
  of a percent of the step).

On a lean step a save that would take the resident bytes past the budget ends the lean path
for the rest of the step (``Executor.lean_limit``, ``on_trip``): from it on, the executor's own
hooks, with what the lean path saved counted and left in place. A storage first saved on either
path is saved again on the same one (its record has handles or has none).

Tensors of other devices, subclasses and sparse layouts take the executor's full path, as does
anything the executor must raise about.
"""
from __future__ import annotations

from threading import get_ident

import torch

from ._eager import frame_callback, mark_eager
from .executor import MAIN_THREAD, Executor
from .interrupts import finalizer
from .records import RELEASED, RESIDENT, UNMARKED, Record, version_error


class _Saved(tuple):
    """What autograd keeps for one saved activation: (alias, version at save, record, gone).
    The alias is a detached alias of the saved tensor (see ``Handle.tensor``: no reference
    cycle through a saved output's ``grad_fn``); ``gone(record)`` is called when it dies."""

    __slots__ = ()

    @finalizer
    def __del__(self) -> None:
        # A Ctrl-C escaping from here is caught by interrupts.py's unraisable hook: raised again
        # at the step boundary, and the executor recounts ``live`` (recount_saved) at settle().
        try:
            self[3](self[2])
        except Exception:  # interpreter shutdown: nothing left to account for
            pass


def recount_saved(ex: Executor) -> None:
    """Set every handle-less record's ``live`` to the number of ``_Saved`` tuples that hold it:
    after an interrupt escaped a ``_Saved.__del__`` its count can be one too high, and the record
    would never be released. One scan of the garbage collector's objects: rare, not cheap."""
    import gc
    counts: dict = {}
    for o in gc.get_objects():
        if type(o) is _Saved:
            counts[id(o[2])] = counts.get(id(o[2]), 0) + 1
    for rec in ex.live:
        if not rec.handles:
            rec.live = counts.get(id(rec), 0)


def resident_hooks(ex: Executor):
    """``(pack, unpack)`` for ``saved_tensors_hooks``: the lean path while ``ex.lean`` holds
    (always on an engine that never moves), records in the executor's dict, the profiler's
    ``raw`` list; the executor's own hooks otherwise (see ``lean`` below)."""
    device, records, lock, live, prof = ex.device, ex._records, ex.lock, ex.live, ex.profiler
    full_pack, full_unpack = ex.pack, ex.unpack
    Tensor, Parameter, strided = torch.Tensor, torch.nn.Parameter, torch.strided
    gone = _gone_inline(ex)
    # The profile reads raw saves and first uses only on an engine that never moves
    # (``Profiler.saves_only``); a lean step of one with a budget keeps none of them.
    keep = prof.saves_only

    def pack(t):
        if frame_callback() is not None:          # called from compiled code: see _eager.py
            return disabled_pack(t)
        if not ex.lean or (type(t) is not Tensor and type(t) is not Parameter) \
                or t.device != device or t.layout != strided:
            return full_pack(t)                   # not lean; another device, a subclass, sparse
        version = t._version
        alias = t.detach()
        base = t._base
        if base is None:
            base = t
        storage = t.untyped_storage()
        # Parameters are leaves: is_leaf first spares activations Parameter's isinstance.
        if (base.is_leaf and (base.requires_grad or isinstance(base, Parameter))) \
                or (ex._any_protected and ex._is_protected(storage)):
            nbytes = storage.nbytes()
            with lock:
                ex.stats.skipped_bytes += nbytes
            if keep:
                prof.raw.append((t.dtype, nbytes))
            return (alias, version)
        with lock:
            rec = records.get(storage)            # present: its device bytes are ours
            if rec is not None:
                if rec.handles or rec.state != RESIDENT:
                    return full_pack(t)           # saved on the executor's path: so again
                rec.live += 1
                if keep:
                    prof.raw.append((t.dtype, rec.nbytes))
                return _Saved((alias, version, rec, gone))
            nbytes = storage.nbytes()
            resident = ex.resident_bytes + nbytes
            limit = ex.lean_limit
            if limit is not None and resident > limit:
                # The step is larger than its size was: the executor's path from here on, which
                # keeps the budget with what the lean path saved counted and left in place.
                ex.lean = False
                if ex.on_trip is not None:
                    ex.on_trip()
                return full_pack(t)
            rec = Record(ex.next_index, nbytes, nbytes < ex.min_tensor_bytes, None, UNMARKED)
            ex.next_index += 1
            rec.storage = storage
            rec.live = 1
            records[storage] = rec
            live.add(rec)
            stats = ex.stats
            stats.saved_bytes += nbytes
            rec.counted = True                    # Executor._count, inlined
            ex.resident_bytes = resident
            if resident > stats.peak_resident_bytes:
                stats.peak_resident_bytes = resident
            if keep:
                prof.raw.append((t.dtype, nbytes, t.shape))
            return _Saved((alias, version, rec, gone))

    def again(t, rec: Record):
        """A lean record's storage saved again off the lean path (``Executor.pack``)."""
        rec.live += 1
        if keep:
            prof.raw.append((t.dtype, rec.nbytes))
        return _Saved((t.detach(), t._version, rec, gone))

    def unpack(h):
        if frame_callback() is not None:
            return disabled_unpack(h)
        if type(h) is _Saved:
            t, version, rec, _ = h
            if rec.state == RELEASED:             # released_all: a failed step, a closed engine
                raise RuntimeError(f"chameleon-swap: {rec.failed}")
            now = t._version
            if now != version:
                raise version_error(t, version, now)
            if not rec.used:                      # one device's backward runs on one thread
                rec.used = True
                if keep:
                    prof.used.append(rec.index)
            return t
        if type(h) is tuple:                      # a parameter or buffer
            t, version = h
            if t._version != version:
                raise version_error(t, version, t._version)
            return t
        return full_unpack(h)

    ex.recount_lean = recount_saved
    ex.lean_again = again
    pack, disabled_pack = mark_eager(pack)
    unpack, disabled_unpack = mark_eager(unpack)
    return pack, unpack


def _gone_inline(ex: Executor):
    records, lock, live = ex._records, ex.lock, ex.live
    # On an engine that can move, a saved tensor can die on a copy worker's thread (a garbage
    # collection there) while the worker's caller holds the lock (``Executor._handle_gone``):
    # there the release never waits for it. If it cannot have it, the record's count is left
    # one too high and ``settle`` recounts the lean records' holders (``recount_saved``) at the
    # next step boundary; until then its bytes stay counted, which errs on the budget's side.
    # On an engine that never moves no thread holds the lock for long: it waits.
    anywhere = ex.resident_only

    def drop(rec: Record) -> None:
        rec.live -= 1
        if rec.live == 0 and rec.state != RELEASED:
            if rec.counted:
                rec.counted = False
                ex.resident_bytes -= rec.nbytes
            rec.state = RELEASED
            live.discard(rec)
            if records.get(rec.storage) is rec:
                del records[rec.storage]
            rec.storage = None

    def gone(rec: Record) -> None:
        """A saved tensor's last reference died (Executor._handle_gone and _release, for a
        record that never left the device). Under the lock: it may die on any thread (an
        autograd device thread, a garbage collection)."""
        if anywhere or get_ident() == MAIN_THREAD:
            with lock:          # (a Ctrl-C lands on the main thread only: ``with`` keeps it)
                drop(rec)
        elif lock.acquire(blocking=False):
            try:
                drop(rec)
            finally:
                lock.release()
        else:
            ex.recount = True
    return gone

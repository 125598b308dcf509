"""Storage records and handles: the executor's books on each saved storage and each saved
tensor (data and the checks on it; ``executor.py`` holds the hooks and the moves).

* record: one device storage that at least one saved tensor lives in, with its state (resident,
  offloading, host, fetching, restored, released) and its host buffer and copy tickets;
* handle: what autograd keeps for one saved tensor: its record and its own size, stride, storage
  offset and dtype, from which the view is rebuilt after the storage came back (LESSONS 4, 12),
  and what is needed to check its version at unpack after the bytes left (LESSONS 11).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..copy.host_pool import HostBuffer
from ._eager import is_compiling as _is_compiling
from . import interrupts
from .interrupts import finalizer


# Record states.
RESIDENT = "resident"      # on device only
OFFLOADING = "offloading"  # on device, copy to host in flight (still counted)
HOST = "host"              # on host only
FETCHING = "fetching"      # on host, copy back in flight (counted)
RESTORED = "restored"      # on device and host, both valid (counted)
RELEASED = "released"

# A record's ``ready`` when it was saved with no budget: no marker was taken, so it must not move.
UNMARKED = "unmarked"


class Record:
    __slots__ = ("index", "nbytes", "small", "state", "device", "host", "ready", "out_ticket",
                 "in_ticket", "handles", "live", "counted", "keep_on_device", "failed", "key", "used",
                 "storage", "__weakref__")

    def __init__(self, index: int, nbytes: int, small: bool, device: Optional[torch.Tensor],
                 ready: object) -> None:
        self.index = index            # save order within the step (first save of this storage)
        self.nbytes = nbytes
        self.small = small            # under min_tensor_bytes: moved only if the budget demands
        self.state = RESIDENT
        self.device = device          # uint8 tensor over the whole device storage once it
                                      # moved (None before: the handles hold the storage)
        self.host: Optional[HostBuffer] = None
        self.ready = ready            # copy engine's "bytes are final" marker from save time,
                                      # UNMARKED when saved with no budget
        self.out_ticket = None
        self.in_ticket = None
        self.handles: list = []       # weak references to this record's Handles
        self.live = 0                 # Handles alive
        self.counted = False          # bytes included in resident_bytes
        self.keep_on_device = False   # unpacked while its copy-out was in flight: keep it
        self.failed: Optional[str] = None
        self.key = None               # the profiler's TensorKey (identity across iterations)
        self.used = False             # backward has needed it this step
        self.storage = None           # its storage object while its device bytes are ours
                                      # (the executor's map is a plain dict, popped at release
                                      # or when the bytes leave)


# Whether witnesses can follow a saved tensor's version once its bytes left (``_make_witness``).
WITNESSES = hasattr(torch._C._autograd, "_unsafe_set_version_counter")


class Handle:
    """Autograd's stand-in for one saved tensor."""

    __slots__ = ("ex", "rec", "tensor", "tref", "bref", "witness", "size", "stride", "offset", "dtype", "version",
                 "conj", "neg", "dirty", "__weakref__")

    def __init__(self, ex, rec: Optional[Record], t: torch.Tensor) -> None:
        self.ex = ex
        self.rec = rec
        # A detached alias of the original while it is on the device: same storage, same version
        # counter, but no autograd metadata. Holding the original would make a reference cycle
        # for saved *outputs* (node -> handle -> output -> grad_fn = node) that Python's gc cannot
        # see through C++, so a graph dropped without backward would never be freed.
        self.tensor: Optional[torch.Tensor] = t.detach()
        # To check the version after we let go of the bytes, the witness (``_make_witness``: the
        # alias turned into a tensor that shares the saved one's version counter, so the base's
        # too, without its storage). Where this torch lacks the private API it rests on, weak
        # references do, taken now: the saved object and, for a view, its base (a temporary view
        # such as ``w.t()`` dies at once, while the base it shares a version counter with is what
        # user code modifies in place). A record that never moves (``rec`` None) needs neither.
        if rec is not None and not WITNESSES:
            self.tref = weakref.ref(t)
            base = t._base
            self.bref = weakref.ref(base) if base is not None else None
        else:
            self.tref = self.bref = None
        self.witness: Optional[torch.Tensor] = None   # see _make_witness
        self.version = t._version
        self.dirty: Optional[int] = None          # version seen when found modified in place
        # size, stride, offset, dtype, conj, neg: taken by keep_geometry() when the alias is
        # dropped; most saved tensors never leave the device and never need them.

    def keep_geometry(self) -> None:
        """Before the device alias goes: what ``rebuild`` needs to make the view again (the
        alias has the saved tensor's size, stride, offset, dtype and conj/neg bits)."""
        t = self.tensor
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.dtype = t.dtype
        self.conj = t.is_conj()
        self.neg = t.is_neg()

    def describe(self) -> str:
        t = self.tensor
        return f"[{t.dtype} {list(t.size())}]" if t is not None else f"[{self.dtype} {list(self.size)}]"

    def rebuild(self, device: torch.Tensor) -> torch.Tensor:
        v = torch.empty(0, dtype=self.dtype, device=device.device).set_(
            device.untyped_storage(), self.offset, self.size, self.stride)
        if self.neg:
            v = torch._neg_view(v)
        if self.conj:
            v = v.conj()
        return v

    def current_version(self) -> Optional[int]:
        """The saved tensor's version now, from whatever still shares its version counter."""
        t = self.tensor
        if t is not None:                 # the common case: no weak reference to follow
            return t._version
        for t in (self.witness, self.tref() if self.tref is not None else None,
                  self.bref() if self.bref is not None else None):
            if t is not None:
                return t._version
        return None

    @finalizer
    def __del__(self) -> None:
        rec = self.rec
        if rec is not None:
            try:
                self.ex._handle_gone(rec)
            except KeyboardInterrupt:
                # Python swallows whatever escapes __del__ ("Exception ignored in"): a Ctrl-C
                # landing here would be lost and the release left half done. The release is
                # finished by Executor.settle() at the next step boundary (or the next read of
                # the engine's counters), and the engine raises the interrupt again at the end
                # of the step (or the start of the next), outside any __del__. One landing
                # before this try is caught by interrupts.py's unraisable hook instead.
                interrupts.caught()
            except Exception:  # interpreter shutdown: nothing left to account for
                pass


class _Need:
    """The size of a hold, asked of the policy like a record's: room for ``nbytes``."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class StepCounters:
    __slots__ = ("saved_bytes", "skipped_bytes", "foreign_bytes", "offloaded_bytes", "offloaded_tensors",
                 "prefetched_bytes", "fetched_bytes", "sync_fetches", "late_prefetches",
                 "budget_waits", "forced_offloads", "kept_bytes", "peak_resident_bytes",
                 "host_deferred_moves")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)




def _set_version(t: torch.Tensor, v: int) -> None:
    try:
        torch._C._autograd._unsafe_set_version_counter((t,), (v,))
    except TypeError:                     # older signature: one tensor, one int
        torch._C._autograd._unsafe_set_version_counter(t, v)


def _make_witness(alias: torch.Tensor) -> Optional[torch.Tensor]:
    """Turn ``alias`` (a detached alias of a saved tensor, ours alone) into a tensor that shares
    the saved tensor's version counter but no longer its storage, so the version can still be
    checked at unpack after the bytes left the device and every user reference is gone
    (LESSONS 11). ``set_`` bumps the shared counter; it is put back at once."""
    if _is_compiling():
        return None
    try:
        v = alias._version
        # ``set_()`` with no source: an empty storage of the alias's own device and dtype, made
        # in C++, a third of what building an empty tensor and setting the alias to it cost (one
        # witness a move). No grad mode needed: the alias is detached, so set_ records nothing.
        alias.set_()
        _set_version(alias, v)
        return alias
    except Exception:                     # no such private API on this torch: weak refs only
        return None


def _version_error(h: Handle, now: int) -> RuntimeError:
    return _inplace_error(h.describe(), h.version, now)


def version_error(t: torch.Tensor, expected: int, now: int) -> RuntimeError:
    """Autograd's in-place error for saved tensor ``t`` (still on the device)."""
    return _inplace_error(f"[{t.dtype} {list(t.size())}]", expected, now)


def _inplace_error(what: str, expected: int, now: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: {what} is at version {now}; expected version "
        f"{expected} instead. (Detected by chameleon-swap, which checks the version that autograd "
        "cannot check for hooked saved tensors.)")

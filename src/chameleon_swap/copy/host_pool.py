"""Host buffers for offloaded storages: carved out of a few large slabs, reused, bounded.

Every offloaded storage needs a host buffer, and on CUDA that buffer must be pinned (page-locked)
for copies to run asynchronously at full speed. Pinning is slow: the OS has to fault in and lock
every page, and measured on an H100 host the first step of each new sequence length took seconds
longer than later ones when buffers were pinned per size. So host memory is kept in an *arena*.
(Why one file, over 400 lines: the slabs, the acquiring threads, the reserve and the grow-ahead
thread share one lock and one set of books: bytes held, in use, on their way; split, every
transition would reach into another module's counters.)

* a few large slabs (pinned on CUDA, plain RAM on the CPU), each sub-allocated for any size by a
  first-fit free list in address order, with neighbours coalesced on release; every buffer starts
  on a 4 KiB boundary (``ALIGN``) and takes a multiple of it, so copies see page-aligned memory;
* with ``ahead=True`` (the engine's arena) it grows *ahead*, off the step: a background thread
  (``chameleon-swap-host-grow``) allocates slabs of at most ``chunk_bytes`` (``GROW_CHUNK_BYTES``,
  256 MiB, or the largest request seen if larger; at least four of the largest request, so a
  slab still fits tensors of a longer step) whenever the free room falls below
  ``HEADROOM_FRACTION`` (0.5) of what is in use (or twice the largest request seen), and at each
  step's end up to ``1 + HEADROOM_FRACTION`` times the most any of the last ``TRIM_WINDOW``
  steps used (which the trim then keeps). Measured on an H100 host (issue 19): a step that
  doubled its arena in one pinned allocation took 8.8-26 s where the plain step took 0.2-0.5 s,
  and with the memory pinned up front the same steps took 0.4-1.2 s. Growing in bounded chunks
  also means no single allocation pins tens of GiB at once. Growth ahead stops where it would
  leave the machine less than ``AHEAD_FLOOR_FRACTION`` of its RAM available (other engines and
  the rest of the process need it); a step then grows the arena itself, up to the limit;
* when no free range fits and no background chunk is on its way, the acquiring thread allocates
  itself (the step waits): a slab of the next power of two of ``max(request, MIN_SLAB_BYTES,
  arena)`` bytes while that is at most ``chunk_bytes``, else ``max(request, chunk_bytes)``, so a
  small arena still doubles and a large one grows chunk by chunk. Every second an acquire spends
  waiting for memory (its own allocation, a background chunk, the ``host_memory_reserve`` slab)
  is counted in ``wait_seconds`` (``StepStats.host_wait_seconds``); bytes allocated on the
  acquiring thread, or by a background thread while an acquire waited for them, are
  ``allocated_bytes`` (``StepStats.host_allocated_bytes``); memory that was ready before anything
  needed it is ``ahead_bytes`` and belongs to no step;
* ``host_memory_reserve`` pins one slab up front instead, on a background thread;
* testing hook: ``alloc_delay_s_per_gib`` (``HostPool`` argument, or the environment variable
  ``CHAMELEON_SWAP_TEST_HOST_ALLOC_DELAY``, seconds per GiB) makes every slab allocation sleep in
  proportion to its size, so that on the CPU, where allocating is fast, the waits and the
  background growth can be measured as they would be with pinning on CUDA;
* it never holds more than ``limit_bytes`` (``host_memory_limit``). A request that cannot fit,
  even after handing back slabs that are wholly free, raises :class:`HostMemoryError` naming the
  limit instead of stalling or crashing;
* it does not keep memory that recent steps did not need: at each step's end, slabs with no
  buffer in use are handed back as long as the arena stays at least as large as the most host
  memory in use during any of the last ``TRIM_WINDOW`` (32) steps (1.5 times that with ``ahead``),
  and as ``host_memory_reserve``. Slabs too small for the largest request of those steps go
  back before the others, and a request takes the smallest slab that fits it: a size whose
  tensors are larger than a chunk keeps the slabs it had to allocate for them.
  A workload that shrinks for good (a long sequence early, short ones after) gives its memory
  back 32 steps later; one that varies within the window keeps what it needs and pins nothing
  new. ``reserved_bytes`` (``Chameleon.host_bytes_reserved``) is what the arena holds.

Why not PyTorch's own pinned memory alone (facts of torch 2.13's caching host allocator, which
``torch.empty(..., pin_memory=True)`` uses on CUDA): it rounds each request up to a power of two
and caches freed blocks by that size, but never splits or merges them. A cached block serves only
a later request of the same rounded size, one tensor per block, so every tensor of a new, larger
shape pins a new block, and up to half of each block is waste. Its ``PYTORCH_CUDA_ALLOC_CONF``
options make pinning faster or rarer but keep that behaviour: ``pinned_use_cuda_host_register``
with ``pinned_num_register_threads`` registers ``malloc``ed memory with several threads,
``pinned_reserve_segment_size_mb`` carves blocks from one segment reserved up front (bump pointer,
never returned), ``pinned_use_background_threads`` reaps copy events off the caller's thread. These
are process-wide settings, not per engine. The arena asks torch for one block per slab, so the
allocator's per-size caching is paid once per slab rather than once per tensor size; when a
slab's size is not a power of two, torch's block behind it is rounded up (pinned memory the
arena's accounting does not see), which is why grown slabs are powers of two where the limit
allows (and why a power of two is the best ``host_memory_reserve`` on CUDA).
"""
from __future__ import annotations

import bisect
import collections
import os
import threading
import time
import weakref
from typing import Callable, Optional

import torch

from ..config import available_host_memory, format_bytes, total_host_memory

ALIGN = 4096                 # page size: every buffer starts on and spans whole pages
MIN_SLAB_BYTES = 2**21       # the first slab: small arenas would otherwise grow in many steps
TRIM_WINDOW = 32             # steps whose host use bounds the arena (see HostPool.end_step)
GROW_CHUNK_BYTES = 2**28     # most one slab allocation takes (unless one request needs more)
# Free room kept ahead of use, as a fraction of the bytes in use. Pinning ahead is not free on
# CUDA: on an H100 lease a first step's reading halved once pinning on its own thread was timed
# as a wait, pinning on the background thread holding up the step's launches too (as a vLLM
# thread reports of background cudaHostRegister, vllm-project/vllm#42632). Memory pinned
# ahead that no step uses is then paid for in step time: at 1.0 the arena asked for twice the
# capped schedule's 29.4 GiB first step, at about a second a GiB. Half is a guess between that
# and pinning inside the next larger step, not measured on a GPU.
HEADROOM_FRACTION = 0.5
# Growth ahead of use is a guess: it never takes the machine's available RAM below this share of
# its total. On an H200 host (126 GiB) two engines of one process each grew ahead to twice a
# 25 GiB step's use, within their own limits (half the RAM each), and the kernel killed the
# process; growth a step needs still goes up to host_memory_limit.
AHEAD_FLOOR_FRACTION = 0.25
ALLOC_DELAY_ENV = "CHAMELEON_SWAP_TEST_HOST_ALLOC_DELAY"   # testing hook: seconds per GiB
ALLOC_SPANS_KEPT = 64        # allocations whose times are kept (a step overlaps the last few)

_open_pools: "weakref.WeakSet[HostPool]" = weakref.WeakSet()


def bytes_held_by_closed_arenas() -> int:
    """Host bytes that arenas of closed engines still hold in this process (slabs whose last
    buffer has not come back yet). Normally 0: ``close()`` hands everything back. The default
    ``host_memory_limit`` adds it to the RAM available, so an engine's earlier allocations do
    not shrink the next engine's default."""
    return sum(p.reserved_bytes for p in list(_open_pools) if p._closed)

_allocating = threading.local()


def allocating_host() -> bool:
    """True on this thread while the arena allocates a slab. On a CPU device, host and device
    are the same RAM: tools that meter device memory (``bench.meter``) read this to leave host
    buffers out, as they would be on a GPU."""
    return getattr(_allocating, "on", False)


class HostMemoryError(RuntimeError):
    """The host arena cannot hold another offloaded tensor within ``host_memory_limit``."""


def align_up(nbytes: int) -> int:
    """``nbytes`` rounded up to whole ``ALIGN`` pages, at least one page."""
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def aligned_host(size: int, pin: bool) -> torch.Tensor:
    """``size`` bytes of host memory (pinned if ``pin``) starting on a page boundary."""
    raw = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % ALIGN
    if skip:
        # The CPU allocator aligns to 64 B only (pinned blocks come page-aligned from the
        # driver): over-allocate by a page and start at the first page boundary.
        raw = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=pin)
        skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + size]


class _Slab:
    """One host allocation and its free ranges: ``_free`` maps start -> length, ``_starts`` keeps
    the starts sorted for first-fit search and for finding a released range's neighbours."""

    __slots__ = ("tensor", "size", "_starts", "_free", "free_bytes", "ahead")

    def __init__(self, size: int, pin: bool) -> None:
        self.tensor = aligned_host(size, pin)
        self.size = size
        self._starts = [0]
        self._free = {0: size}
        self.free_bytes = size
        self.ahead = False      # allocated off the step, not yet waited for by any acquire

    def take(self, n: int) -> Optional[int]:
        """Offset of a free range of ``n`` bytes (the lowest that fits), or None."""
        for i, start in enumerate(self._starts):
            length = self._free[start]
            if length >= n:
                del self._free[start]
                if length == n:
                    del self._starts[i]
                else:
                    self._starts[i] = start + n   # the rest of the range stays in order
                    self._free[start + n] = length - n
                self.free_bytes -= n
                return start
        return None

    def fits(self, n: int) -> bool:
        """Whether ``take(n)`` would find a free range (takes nothing)."""
        return self.free_bytes >= n and any(length >= n for length in self._free.values())

    def give(self, start: int, n: int) -> None:
        """Return ``[start, start + n)``, merged with free neighbours on either side."""
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] < start + n or \
                i > 0 and self._starts[i - 1] + self._free[self._starts[i - 1]] > start:
            raise RuntimeError(f"host arena: range [{start}, {start + n}) is already free")
        self.free_bytes += n
        if i < len(self._starts) and self._starts[i] == start + n:     # merge the right neighbour
            n += self._free.pop(self._starts.pop(i))
        if i > 0 and self._starts[i - 1] + self._free[self._starts[i - 1]] == start:
            self._free[self._starts[i - 1]] += n                         # grow the left neighbour
            return
        self._starts.insert(i, start)
        self._free[start] = n

    def free_ranges(self) -> list[tuple[int, int]]:
        return [(s, self._free[s]) for s in self._starts]


class HostBuffer:
    """A range of a slab; ``view(nbytes)`` is the uint8 prefix a storage is copied into."""

    __slots__ = ("capacity", "slab", "offset", "live")

    def __init__(self, slab: _Slab, offset: int, capacity: int) -> None:
        self.capacity = capacity
        self.slab = slab
        self.offset = offset
        self.live = True

    @property
    def tensor(self) -> torch.Tensor:
        """The whole range as a uint8 tensor over the slab."""
        return self.slab.tensor[self.offset:self.offset + self.capacity]

    def view(self, nbytes: int) -> torch.Tensor:
        # One slice of the slab, made when a copy needs it: a move asks for it once each way,
        # and a range kept as a tensor of its own cost a second slice per move.
        if not 0 <= nbytes <= self.capacity:
            raise ValueError(f"nbytes must be within this buffer's capacity "
                             f"{self.capacity}; got {nbytes}")
        return self.slab.tensor[self.offset:self.offset + nbytes]


class HostPool:
    """The host arena of one engine. Thread-safe: copies complete (and release buffers) on other
    threads than the ones that acquire.

    ``reserve_bytes`` are allocated as one slab on a background thread started here. An
    ``acquire`` that arrives before that slab exists waits for it (it never allocates a second
    slab beside it, which could break the limit); ``wait_reserve()`` does the same explicitly.
    """

    def __init__(self, limit_bytes: int, *, pin: bool, reserve_bytes: int = 0,
                 chunk_bytes: int = GROW_CHUNK_BYTES, ahead: bool = False,
                 alloc_delay_s_per_gib: Optional[float] = None,
                 machine_memory: Optional[Callable[[], tuple]] = None) -> None:
        self.limit_bytes = int(limit_bytes)
        # () -> (available, total) bytes of the machine's RAM, either None where unknown.
        self._machine_memory = machine_memory or _machine_memory
        self.pin = pin
        if chunk_bytes < ALIGN:
            raise ValueError(f"chunk_bytes must be at least {ALIGN} (one page); got {chunk_bytes}")
        self.chunk_bytes = align_up(chunk_bytes)
        self.ahead = ahead          # keep free room ahead of use, grown on a background thread
        if alloc_delay_s_per_gib is None:
            alloc_delay_s_per_gib = float(os.environ.get(ALLOC_DELAY_ENV, "0") or 0)
        if not alloc_delay_s_per_gib >= 0:
            raise ValueError(f"alloc_delay_s_per_gib must be >= 0 seconds per GiB; "
                             f"got {alloc_delay_s_per_gib!r}")
        self.alloc_delay_s_per_gib = alloc_delay_s_per_gib
        if reserve_bytes > self.limit_bytes:
            raise ValueError(f"host_memory_reserve={format_bytes(reserve_bytes)} is more than "
                             f"host_memory_limit={format_bytes(self.limit_bytes)}")
        self._slabs: list[_Slab] = []
        self._out: set[HostBuffer] = set()     # buffers handed out (see settle)
        self._step_peak = 0                    # most bytes in use since the last end_step
        self._recent: collections.deque = collections.deque(maxlen=TRIM_WINDOW)
        self._step_largest = 0                 # largest request since the last end_step
        self._recent_largest: collections.deque = collections.deque(maxlen=TRIM_WINDOW)
        self._lock = threading.Lock()
        self._landed = threading.Condition(self._lock)   # a background slab was added
        self._closed = False
        self.wait_seconds = 0.0     # time acquires spent waiting for host memory (all steps)
        self.ahead_bytes = 0        # bytes allocated off the step before anything needed them
        self._pending = 0           # bytes the grow thread is allocating now
        self._target = 0            # arena size the grow thread works towards
        self._queued = 0            # size of the chunk handed to the grow thread (0: none)
        self._largest = 0           # largest request seen
        self._grower: Optional[threading.Thread] = None
        self.reserved_bytes = 0     # bytes of all slabs held now (buffers in use or free)
        self.in_use_bytes = 0       # capacity of buffers handed out and not yet returned
        self.peak_in_use_bytes = 0
        self.allocations = 0        # slabs allocated so far (flat once the arena is warm)
        self.allocated_bytes = 0    # bytes of those slabs (differences give a step's growth)
        # When slabs were allocated, any thread (``allocating_seconds``): the last few, and the
        # start of one under way per thread (None when none is)
        self._alloc_spans: collections.deque = collections.deque(maxlen=ALLOC_SPANS_KEPT)
        self._alloc_now: dict = {}
        self._reserve_error: Optional[BaseException] = None
        self._reserve_bytes = align_up(reserve_bytes) if reserve_bytes else 0
        self._reserved = threading.Event()
        self._reserver: Optional[threading.Thread] = None
        if self._reserve_bytes:
            self._reserve_bytes = min(self._reserve_bytes, self.limit_bytes // ALIGN * ALIGN)
            self._reserver = threading.Thread(target=self._reserve, daemon=True,
                                              name="chameleon-swap-host-reserve")
            self._reserver.start()
        else:
            self._reserved.set()
        _open_pools.add(self)

    # ------------------------------------------------------------------ state
    @property
    def cached_bytes(self) -> int:
        """Bytes of the arena not handed out (free ranges of all slabs)."""
        return self.reserved_bytes - self.in_use_bytes

    @property
    def slab_sizes(self) -> list[int]:
        with self._lock:
            return [s.size for s in self._slabs]

    def free_ranges(self) -> list[tuple[int, int, int]]:
        """(slab index, offset, length) of every free range, for tests and diagnostics."""
        with self._lock:
            return [(i, s, n) for i, slab in enumerate(self._slabs) for s, n in slab.free_ranges()]

    # ------------------------------------------------------------------ reserve
    def _reserve(self) -> None:
        try:
            slab = self._new_slab(self._reserve_bytes)
        except BaseException as e:       # reported to the thread that next needs the arena
            self._reserve_error = e
        else:
            with self._lock:
                if not self._closed:
                    self._add_locked(slab, ahead=True)
        finally:
            self._reserved.set()

    def wait_reserve(self, timeout: Optional[float] = None) -> bool:
        """Block until the ``host_memory_reserve`` slab is allocated (True), or ``timeout``
        seconds passed (False). Raises :class:`HostMemoryError` if allocating it failed."""
        if not self._reserved.wait(timeout):
            return False
        if self._reserve_error is not None:
            raise HostMemoryError(
                f"host_memory_reserve={format_bytes(self._reserve_bytes)} could not be allocated "
                f"{'(pinned) ' if self.pin else ''}on its background thread: "
                f"{self._reserve_error}. Lower host_memory_reserve or leave it None."
            ) from self._reserve_error
        return True

    # ------------------------------------------------------------------ acquire / release
    def acquire(self, nbytes: int) -> HostBuffer:
        if not self._reserved.is_set() or self._reserve_error is not None:
            t0 = time.perf_counter()
            late = not self._reserved.is_set()
            self.wait_reserve()
            with self._lock:
                self.wait_seconds += time.perf_counter() - t0
                if late:
                    # Waited for: the reserve was not ready before the step needed it.
                    for slab in self._slabs[:1]:
                        self._count_waited_locked(slab)
        n = align_up(nbytes)
        with self._lock:
            if self._closed:
                raise RuntimeError("this host arena is closed (its engine was closed)")
            self._largest = max(self._largest, n)
            self._step_largest = max(self._step_largest, n)
            buf = self._take_locked(n)
            if buf is None:
                t0 = time.perf_counter()
                while buf is None and self._pending:
                    # A background chunk is on its way: wait for it rather than allocate a
                    # second slab beside it (which could break the limit).
                    self._landed.wait()
                    if self._closed:
                        raise RuntimeError("this host arena is closed (its engine was closed)")
                    buf = self._take_locked(n)
                    if buf is not None:
                        self._count_waited_locked(buf.slab)
                if buf is None:
                    self._grow_locked(n)
                    buf = self._take_locked(n)
                    assert buf is not None, "a new slab always fits its request"
                self.wait_seconds += time.perf_counter() - t0
            self.in_use_bytes += n
            self._out.add(buf)
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
            self._step_peak = max(self._step_peak, self.in_use_bytes)
            if self.ahead:
                self._keep_ahead_locked()
            return buf

    def ready(self, nbytes: int) -> bool:
        """Whether ``acquire(nbytes)`` would find a free range now, without allocating or
        waiting (always, where allocating is fast: plain RAM, no testing delay). Never blocks
        (it allocates nothing on the calling thread): a step asks it
        before a copy-out the budget does not need yet, and moves that tensor later if the
        answer is no (issue 19: a step that would have waited moves less). With ``ahead`` a
        no also asks the background thread for room, so a later save finds it ready. True
        where ``acquire`` would fail at once instead (a closed arena, a reserve that could not
        be allocated), so the error is reported where it was before."""
        if self._reserve_error is not None or not (self.pin or self.alloc_delay_s_per_gib):
            return True     # (plain RAM: allocating is a malloc, nothing worth putting off)
        if not self._reserved.is_set():
            return False                      # the reserve slab is still being allocated
        n = align_up(nbytes)
        with self._lock:
            if self._closed:
                return True
            if any(slab.fits(n) for slab in self._slabs):
                return True
            # Wanted, if not used: the step's end keeps room for it rather than trimming it.
            self._step_peak = max(self._step_peak, self.in_use_bytes + n)
            self._step_largest = max(self._step_largest, n)
            if self.ahead and self._pending < n:     # none on its way could hold it
                self._largest = max(self._largest, n)
                self._ask_locked(max(self._target, self.reserved_bytes + self._pending
                                     + max(n, 2 * self._largest)))
            return False

    def room(self, nbytes: int, ask: bool = True) -> bool:
        """Whether the arena has ``nbytes`` free now, in all (a step's moves, not one tensor's
        range), on an arena whose allocations are slow (pinned, or the testing delay); always
        where allocating is fast. Never blocks. With ``ask``, a no counts ``nbytes`` as wanted
        by the step (its end keeps room for them rather than trimming, and grows to 1.5x of
        them ahead) and, with ``ahead``, has the background thread grow the arena to hold them
        now: a step with no plan asks it before keeping blocks whose moves would wait for
        pinning (``policy/host_room.py``)."""
        if self._reserve_error is not None or not (self.pin or self.alloc_delay_s_per_gib):
            return True
        if not self._reserved.is_set():
            return False                      # the reserve slab is still being allocated
        n = align_up(nbytes)
        with self._lock:
            if self._closed or self.reserved_bytes - self.in_use_bytes >= n:
                return True
            if ask:
                self._step_peak = max(self._step_peak, self.in_use_bytes + n)
                if self.ahead:
                    self._ask_locked(max(self._target, self.in_use_bytes + n))
            return False

    def would_block(self, nbytes: int) -> bool:
        """Whether ``acquire(nbytes)`` would wait (for the reserve, a background chunk, or a
        new slab allocated on the calling thread) on an arena whose allocations are slow
        (pinned, or the testing delay). Changes nothing, unlike ``ready``: the caller times
        such an acquire as a wait (``runtime.executor``)."""
        if not (self.pin or self.alloc_delay_s_per_gib):
            return False
        if not self._reserved.is_set():
            return True
        n = align_up(nbytes)
        with self._lock:
            return not self._closed and not any(slab.fits(n) for slab in self._slabs)

    def _count_waited_locked(self, slab: "_Slab") -> None:
        """A background slab an acquire had to wait for was on the step's critical path."""
        if getattr(slab, "ahead", False):
            slab.ahead = False
            self.ahead_bytes -= slab.size
            self.allocated_bytes += slab.size

    # ------------------------------------------------------------------ grow ahead
    def grow_ahead(self, target_bytes: int) -> None:
        """Have the background thread grow the arena to ``target_bytes`` (within the limit), in
        slabs of at most ``chunk_bytes``; returns at once."""
        with self._lock:
            self._ask_locked(target_bytes)

    def wait_ahead(self, timeout: Optional[float] = None) -> bool:
        """Block until the background thread has nothing left to allocate (True), or
        ``timeout`` seconds passed (False). For tests and benchmarks: steps never call it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._landed.wait(0.05 if left is None else min(left, 0.05))
            return True

    def _keep_ahead_locked(self) -> None:
        room = self.cached_bytes + self._pending
        want = max(int(self.in_use_bytes * HEADROOM_FRACTION), 2 * self._largest)
        if room < want:
            self._ask_locked(self.reserved_bytes + self._pending + want - room)

    def _ask_locked(self, target_bytes: int) -> None:
        if self._closed:
            return
        target = min(int(target_bytes), self.limit_bytes) // ALIGN * ALIGN
        self._target = target           # the latest ask: the step's end lowers it again
        self._schedule_locked()

    def _schedule_locked(self) -> None:
        """Hand the background thread its next chunk, if the arena is short of its target. The
        chunk counts in ``_pending`` from here on, so an acquire that finds no room knows a slab
        is on its way and waits for it instead of allocating one beside it."""
        if self._closed or self._queued:
            return
        short = self._target - self.reserved_bytes - self._pending
        room = self.limit_bytes - self.reserved_bytes - self._pending
        if short < ALIGN:
            return
        # What is short, rounded up to a power of two, at least MIN_SLAB_BYTES and four of the
        # largest request seen (tensors grow with the sequence: a slab sized for one of today's
        # would fit none of a longer step's), at most a chunk unless one request is larger.
        want = max(_next_pow2(short), MIN_SLAB_BYTES, 4 * self._largest)
        size = min(max(min(want, self.chunk_bytes), self._largest), room) // ALIGN * ALIGN
        if size < ALIGN:
            return
        self._pending += size
        self._queued = size
        if self._grower is None:
            # The thread lives while it has chunks to allocate, so an engine dropped without
            # close() leaves no thread holding its arena.
            self._grower = threading.Thread(target=self._grow_loop, daemon=True,
                                            name="chameleon-swap-host-grow")
            self._grower.start()

    def _grow_loop(self) -> None:
        while True:
            with self._lock:
                size = self._queued
                if self._closed or not size:
                    self._grower = None
                    return
            slab = None
            if self._machine_has_room(size):
                try:
                    slab = self._new_slab(size)
                except BaseException:      # out of memory here: the acquiring thread will try
                    slab = None            # (and report a clear error if it cannot either)
            with self._lock:
                self._pending -= size
                self._queued = 0
                if slab is None:
                    self._target = self.reserved_bytes    # stop growing ahead
                elif not self._closed:
                    self._add_locked(slab, ahead=True)
                self._landed.notify_all()
                self._schedule_locked()

    def _machine_has_room(self, size: int) -> bool:
        """Whether growing ``size`` bytes ahead leaves the machine ``AHEAD_FLOOR_FRACTION`` of
        its RAM available (True where either figure is unknown)."""
        available, total = self._machine_memory()
        return available is None or total is None or \
            available - size >= AHEAD_FLOOR_FRACTION * total

    def release(self, buf: HostBuffer) -> None:
        with self._lock:
            if not buf.live:
                raise RuntimeError("host arena: this buffer was already released")
            buf.live = False
            self._out.discard(buf)
            self.in_use_bytes -= buf.capacity
            buf.slab.give(buf.offset, buf.capacity)
            if self._closed and buf.slab.free_bytes == buf.slab.size:
                self._drop_locked(buf.slab)    # the last buffer of a closed arena came back

    def _take_locked(self, n: int) -> Optional[HostBuffer]:
        # The smallest slab with a range that fits (``_slabs`` is in size order): large slabs
        # stay whole for the large tensors only they can hold.
        for slab in self._slabs:
            if slab.free_bytes >= n:
                offset = slab.take(n)
                if offset is not None:
                    return HostBuffer(slab, offset, n)
        return None

    def _grow_locked(self, n: int) -> None:
        if self.in_use_bytes + n > self.limit_bytes:
            raise HostMemoryError(
                f"host_memory_limit reached: {format_bytes(self.in_use_bytes)} of host memory "
                f"already hold offloaded activations and {format_bytes(n)} more are needed, over "
                f"host_memory_limit={format_bytes(self.limit_bytes)}. Raise host_memory_limit, "
                f"raise the device budget, or shrink the step.")
        # Doubling while the arena is small, then a chunk at a time (or the request, if larger).
        want = _next_pow2(max(n, MIN_SLAB_BYTES, self.reserved_bytes))
        if want > self.chunk_bytes:
            want = max(n, self.chunk_bytes)
        if self.reserved_bytes + n > self.limit_bytes or \
                self.reserved_bytes + want > self.limit_bytes:
            # Slabs with nothing in use go back first: one new slab can then take their room.
            # (Acquire waited for every background chunk first: none is on its way.)
            for slab in [s for s in self._slabs if s.free_bytes == s.size]:
                self._drop_locked(slab)
        room = (self.limit_bytes - self.reserved_bytes) // ALIGN * ALIGN
        if n > room:
            raise HostMemoryError(
                f"host_memory_limit reached: {format_bytes(self.in_use_bytes)} of host memory "
                f"hold offloaded activations and {format_bytes(n)} more are needed; the "
                f"{format_bytes(self.cached_bytes)} free in the arena are split into ranges too "
                f"small for it, and host_memory_limit={format_bytes(self.limit_bytes)} leaves no "
                f"room for a new slab. Raise host_memory_limit (or set host_memory_reserve to "
                f"pin one slab for the whole step up front), or raise the device budget.")
        self._add_locked(self._new_slab(min(want, room)))

    def _new_slab(self, size: int) -> _Slab:
        _allocating.on = True
        me, t0 = threading.get_ident(), time.perf_counter()
        self._alloc_now[me] = t0
        try:
            if self.alloc_delay_s_per_gib:
                time.sleep(self.alloc_delay_s_per_gib * size / 2**30)   # testing hook
            return _Slab(size, self.pin)
        finally:
            _allocating.on = False
            self._alloc_spans.append((t0, time.perf_counter()))
            self._alloc_now.pop(me, None)

    def allocating_seconds(self, since: float, until: float) -> float:
        """Seconds of ``[since, until]`` (``time.perf_counter``) that slab allocations overlapped,
        on any thread (the step's own, the grow-ahead and reserve threads), summed over the
        allocations. On CUDA that is pinning, which slows a step even from a background thread
        (measured on an H100: a first step that pinned 8 GiB took 11-16 s for 0.3 s of work);
        the policy reads a step that overlapped much of it as not telling its plan's times."""
        spans = list(self._alloc_spans) + [(t, until) for t in list(self._alloc_now.values())]
        return sum(max(0.0, min(e, until) - max(s, since)) for s, e in spans)

    def _add_locked(self, slab: _Slab, ahead: bool = False) -> None:
        # In size order (after slabs of the same size): see _take_locked
        self._slabs.insert(bisect.bisect_right([s.size for s in self._slabs], slab.size), slab)
        self.reserved_bytes += slab.size
        self.allocations += 1
        slab.ahead = ahead
        if ahead:
            self.ahead_bytes += slab.size
        else:
            self.allocated_bytes += slab.size

    def _drop_locked(self, slab: _Slab) -> None:
        self._slabs.remove(slab)
        self.reserved_bytes -= slab.size

    # ------------------------------------------------------------------ between steps
    def end_step(self) -> None:
        """Hand back wholly free slabs while the arena stays at least as large as the most in
        use during any of the last ``TRIM_WINDOW`` steps (and as ``host_memory_reserve``):
        the arena is bounded by what recent steps used, not by the largest step ever."""
        with self._lock:
            self._recent.append(self._step_peak)
            self._step_peak = self.in_use_bytes
            self._recent_largest.append(self._step_largest)
            self._step_largest, large = 0, max(self._recent_largest)
            recent = max(self._recent)
            if self.ahead:
                # Room for the next step to be larger than any recent one, grown now, off the
                # step; kept by the trim below, so it is not pinned again every step.
                recent = min(int(recent * (1 + HEADROOM_FRACTION)), self.limit_bytes)
            keep = max(recent, self._reserve_bytes)
            dropped = False
            # Slabs too small for the largest recent request go first, largest first, then
            # the rest, largest first: trimmed largest-first alone, the slabs a size of
            # larger tensors than any chunk had to allocate were the first to go at its
            # step's end, and each of its visits allocated them again (reproduced on the CPU
            # with the testing delay; a possible cause of the 1.2-1.3 s host waits of every
            # visit of a capped schedule's selective steps on the H100, not verified there).
            for slab in sorted((s for s in self._slabs if s.free_bytes == s.size),
                               key=lambda s: (s.size >= large, -s.size)):
                if self.reserved_bytes - slab.size >= keep:
                    self._drop_locked(slab)
                    dropped = True
            if self.ahead:
                self._ask_locked(keep)
        if dropped and self.pin:
            _empty_host_cache()   # torch caches freed pinned blocks: give the pages back

    def settle(self, held) -> None:
        """With no copy in flight: make the accounting whole after an asynchronous exception
        (a Ctrl-C) cut an acquire, a release or a deferred release short. ``held`` are the
        buffers records still hold; every other buffer handed out is returned, and the free
        ranges and byte counts are rebuilt from the buffers that remain."""
        held = {id(b) for b in held}
        with self._lock:
            for b in self._out:
                if id(b) not in held:
                    b.live = False           # its record is gone: a late release is an error
            self._out = {b for b in self._out if b.live}
            for slab in self._slabs:
                taken = sorted((b.offset, b.capacity) for b in self._out if b.slab is slab)
                starts, free, at = [], {}, 0
                for off, cap in taken + [(slab.size, 0)]:
                    if off > at:
                        starts.append(at)
                        free[at] = off - at
                    at = max(at, off + cap)
                slab._starts, slab._free = starts, free
                slab.free_bytes = sum(free.values())
            self.in_use_bytes = sum(b.capacity for b in self._out)
            self._step_peak = max(self._step_peak, self.in_use_bytes)
            if self._closed:
                for slab in [s for s in self._slabs if s.free_bytes == s.size]:
                    self._drop_locked(slab)

    # ------------------------------------------------------------------ teardown
    def clear(self) -> None:
        """Hand back every slab with no buffer in use (slabs in use stay until they empty)."""
        if self._reserver is not None:       # a reserve still being pinned is dropped as well
            self._reserver.join()
        with self._lock:
            for slab in [s for s in self._slabs if s.free_bytes == s.size]:
                self._drop_locked(slab)

    def close(self) -> None:
        """Hand back everything: free slabs now, the others when their last buffer returns.
        On CUDA torch's host allocator keeps freed pinned blocks cached; its cache is emptied
        so the pages are unlocked and go back to the OS."""
        with self._lock:
            self._closed = True
            self._target = 0
            self._landed.notify_all()
            grower = self._grower
        if grower is not None and grower is not threading.current_thread():
            grower.join()                      # a chunk being allocated is dropped as it lands
        self.clear()
        if self.pin:
            _empty_host_cache()


def _machine_memory() -> tuple:
    return available_host_memory(), total_host_memory()


def _empty_host_cache() -> bool:
    """Empty torch's cache of freed pinned blocks; False where this torch offers no way to.
    The public ``torch.accelerator.empty_host_cache`` is recent (torch 2.13 has it; its torch._C
    name too), and older versions have the operation only under a private name. On the project's
    H200 run (torch 2.11) two closed engines' pinned memory (about 80 GiB) did not come back
    until the process ended, and the next engines' default limit (half the RAM available) fell
    to 11 GiB; this torch having no public call is the likely cause, not a verified one."""
    accelerator = getattr(torch, "accelerator", None)
    for fn in (getattr(accelerator, "empty_host_cache", None),
               getattr(torch._C, "_accelerator_emptyHostCache", None),
               getattr(torch._C, "_host_emptyCache", None)):
        if callable(fn):
            fn()
            return True
    return False

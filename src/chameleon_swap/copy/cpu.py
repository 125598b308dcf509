"""CPU copy engine: two worker threads stand in for the D2H and H2D copy streams (with an
emulated link, its clock does: ``bytes_per_s`` below).

"Device" and "host" are both RAM here, so nothing is saved in bytes; what this backend buys is the
same asynchrony, ordering and lifetime rules as CUDA, exercised by every CPU test:

* a worker reads its source through a weak reference, so a source freed before its copy ran is
  an error (``RuntimeError`` at the fetch that needed it), not silently read garbage (LESSONS 1);
* copy-back waits for the copy-out it depends on (LESSONS 2): the two workers are independent;
* ``delay_s`` (test-only; also ``CHAMELEON_SWAP_TEST_COPY_DELAY`` seconds) sleeps before every copy,
  so a missing wait shows up as wrong bytes instead of passing by luck;
* each worker keeps the CPU time its copies took (``take_cpu``: their Python and their memmove,
  not the emulated link's sleep): on a CPU that is what a move costs the machine beyond the
  compute thread's own part of it, since the workers' Python holds the interpreter lock the
  compute thread needs, and with every core busy their memmoves take a core from compute
  (measured on this project's 2-core CPU, the demo's Llama with two blocks kept: 0.18 ms of
  worker CPU a move, where the compute thread's timed part was 0.16-0.20 ms and the step ran
  0.26-0.49 ms longer a move than with room to move nothing);
* ``bytes_per_s`` (``Chameleon(emulate_link=...)``) makes every copy take as long as a link of
  that bandwidth would, so a 2-core CPU reproduces a GPU's ratio of bytes to compute (an H100's
  pinned link moves about 54 GB/s against its step's compute). The link is a clock
  (``_Link``): the calling thread moves the bytes at once (a memmove), and the copy counts as done
  when they would have crossed the link, queued behind the copies ahead of it in its direction.
  Nothing sleeps but a thread that waits for a copy, as it would on a GPU. The copy threads
  stand in for it only under ``delay_s`` (the ordering tests' hook): there the worker copies,
  then sleeps the rest of ``nbytes / bytes_per_s``. Why a clock: on this project's 2-core CPU the
  threads' hand-offs of the interpreter lock cost the compute thread more than the memmoves
  (the demo's Llama at 25%, 80 moves a step, link made infinitely fast: 132-143 ms steps with
  the threads, 109-111 ms with the memmoves on the compute thread, 84-97 ms moving nothing), a
  cost a GPU's copy engines do not have. Paired in one process on 2026-11-27 (HF Llama 256x4,
  384 tokens, 200 MB/s, swap only, two runs), over the plain step, threads then clock: 25% of
  the peak 1.62x / 1.46x and 1.60x / 1.43x; 50% 1.37x / 1.25x and 1.30x / 1.17x; 75% 1.10x /
  1.14x and 1.15x / 1.08x.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import threading
import time
import weakref
from collections import deque
from typing import Callable, Optional

import torch


def _no_slot() -> int:
    return -1


class CpuTicket:
    """A copy's completion: a lock held from issue until the copy ends (cheaper than an Event,
    whose Python-level condition costs the worker and the waiter a few microseconds a copy)."""
    __slots__ = ("_lock", "_done", "error")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self.error: Optional[str] = None

    def done(self) -> bool:
        return self._done

    def _finish(self, error: Optional[str] = None) -> None:
        self.error = error
        self._done = True
        self._lock.release()

    def _block(self) -> None:
        if not self._done:
            with self._lock:          # (released by _finish: waiters pass through one by one)
                pass


class _Worker(threading.Thread):
    def __init__(self, name: str, delay_s: float, bytes_per_s: Optional[float] = None) -> None:
        super().__init__(name=name, daemon=True)
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()   # (C: no Python condition)
        self.delay_s = delay_s
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0            # the emulated link's clock: when its last copy ends
        self.lock = threading.Lock()
        self.busy = [0, 0.0]          # bytes copied and seconds spent copying, since last taken
        self.cpu = 0.0                # this thread's CPU seconds in its jobs, since last taken

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            src_ref, dst_ref, ticket, after = job
            c0 = time.thread_time()         # (waits and sleeps below take none)
            if after is not None:
                after._block()
                if after.error:
                    ticket._finish(f"depends on a failed copy: {after.error}")
                    continue
            if self.delay_s:
                time.sleep(self.delay_s)
            src, dst = src_ref(), dst_ref()
            if src is None or dst is None:
                ticket._finish(f"{self.name}: {'source' if src is None else 'destination'} "
                               "was freed before its copy ran")
                continue
            try:
                t0 = time.perf_counter()
                copy_bytes(dst, src)
                took = time.perf_counter() - t0
                if self.bytes_per_s:
                    # The emulated link: the copy ends when its bytes would have crossed a link
                    # of that speed, on a link clock that runs on from the previous copy's end
                    # (a sleep that overshoots is not carried into the next copy's time).
                    start = max(t0, self.free_at)
                    self.free_at = start + max(took, src.numel() / self.bytes_per_s)
                    took = self.free_at - start
                    rest = self.free_at - time.perf_counter()
                    if rest > 0:
                        time.sleep(rest)
                with self.lock:
                    self.busy[0] += src.numel()
                    self.busy[1] += took
                    self.cpu += time.thread_time() - c0
                error = None
            except Exception as e:  # surfaced to the thread that waits on the ticket
                error = f"{self.name}: {type(e).__name__}: {e}"
            # Drop the strong references before signalling: a worker idling in jobs.get() with
            # the last source still bound would keep that device storage alive after its record
            # stopped counting it (found by the independent residency check in test_engine).
            del src, dst, job
            ticket._finish(error)


class _LinkTicket:
    """A copy on the emulated link's clock: its bytes moved at issue, done at ``ready_at``
    (``time.perf_counter``); ``error`` when the memmove failed (raised at the wait)."""
    __slots__ = ("ready_at", "error")

    def __init__(self, ready_at: float, error: Optional[str] = None) -> None:
        self.ready_at = ready_at
        self.error = error

    def done(self) -> bool:
        return self.error is not None or time.perf_counter() >= self.ready_at

    def _block(self) -> None:
        rest = self.ready_at - time.perf_counter()
        if rest > 0 and self.error is None:
            time.sleep(rest)


class _Link:
    """One direction of the emulated link as a clock: when its last copy ends, and what it has
    carried since last taken (``busy``: bytes, seconds), as a worker keeps them."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0
        self.lock = threading.Lock()
        self.busy = [0, 0.0]
        self.cpu = 0.0                # (the copies run on the calling thread: timed there)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> _LinkTicket:
        if after is not None:
            if not isinstance(after, _LinkTicket):
                after._block()        # (a ticket of another engine: wait for it)
            if after.error:
                return _LinkTicket(0.0, f"depends on a failed copy: {after.error}")
        t0 = time.perf_counter()
        try:
            copy_bytes(dst, src)
        except Exception as e:        # surfaced to the thread that waits on the ticket
            return _LinkTicket(0.0, f"emulated link: {type(e).__name__}: {e}")
        took = time.perf_counter() - t0
        with self.lock:               # (take_link reads busy from the step's end)
            start = max(t0, self.free_at, getattr(after, "ready_at", 0.0))
            self.free_at = start + max(took, src.numel() / self.bytes_per_s)
            self.busy[0] += src.numel()
            self.busy[1] += self.free_at - start
            return _LinkTicket(self.free_at)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy one contiguous byte buffer into another with a plain memmove.

    Not ``dst.copy_(src)``: a large ``copy_`` runs an OpenMP parallel region, and each worker
    thread that starts one gets an OpenMP team of its own whose idle threads spin, stealing the
    cores compute runs on (measured: steps of other models in the process went from 3 ms to
    hundreds of ms with a few engines alive on 2 cores). A memmove is one thread, like one copy
    stream, and ctypes releases the GIL while it runs."""
    n = src.numel()
    if not (src.dtype == dst.dtype == torch.uint8 and dst.numel() == n
            and src.is_contiguous() and dst.is_contiguous()):
        raise RuntimeError(f"copy_bytes needs two contiguous uint8 buffers of one size; got "
                           f"{src.dtype}[{n}] -> {dst.dtype}[{dst.numel()}]")
    if n:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)


class CpuCopyEngine:
    device = torch.device("cpu")

    def __init__(self, delay_s: Optional[float] = None,
                 bytes_per_s: Optional[float] = None, threads: Optional[bool] = None) -> None:
        """``threads``: copies on the two worker threads (the default without ``bytes_per_s``,
        or with ``delay_s``), else on the emulated link's clock (see the module docstring)."""
        if delay_s is None:
            delay_s = float(os.environ.get("CHAMELEON_SWAP_TEST_COPY_DELAY", "0") or 0)
        self.delay_s = delay_s
        self.bytes_per_s = bytes_per_s           # the emulated link (None: a plain memmove)
        if threads is None:
            threads = bytes_per_s is None or bool(delay_s)
        if not threads and bytes_per_s is None:
            raise ValueError("threads=False needs bytes_per_s: the emulated link is its clock")
        self.clocked = not threads
        if self.clocked:
            self._d2h, self._h2d = _Link(bytes_per_s), _Link(bytes_per_s)
        else:
            self._d2h = _Worker("chameleon-d2h", delay_s, bytes_per_s)
            self._h2d = _Worker("chameleon-h2d", delay_s, bytes_per_s)
            self._d2h.start()
            self._h2d.start()
            # Stop the threads when the engine is garbage collected without close().
            weakref.finalize(self, _stop_workers, self._d2h, self._h2d)
        # (ticket, keep-alive object, callback) in issue order; done tickets are reaped by poll().
        self._deferred: deque = deque()
        # On the link's clock, when the first deferred copy is done (its ``ready_at``): a poll
        # before then has nothing to do. A poll runs at every save, and scanning the list made
        # about 2000 ``done`` calls a step of the hybrid benchmark's Llama at 25% of its peak.
        self._poll_at = float("inf")
        self._stalls: list[tuple[int, float]] = []   # (slot, seconds) per wait of this step
        # () -> the profiler's current slot, asked at each wait (only when one happens); the
        # engine sets it, so waits are kept apart from the compute of the slot they fell in.
        self.stall_slot: Callable[[], int] = _no_slot
        # () -> seconds: the clock waits are timed on; the engine gives the profiler's, so that
        # the waits it takes out of a slot's compute are on the clock the slot was measured on.
        self.clock: Callable[[], float] = time.perf_counter

    def record_ready(self) -> None:
        return None  # CPU compute is synchronous: the bytes are final when the hook runs

    def offload(self, src: torch.Tensor, dst: torch.Tensor, ready: object) -> CpuTicket:
        if self.clocked:
            return self._d2h.copy(dst, src)
        ticket = CpuTicket()
        # The worker holds only weak references; the deferred list below is what keeps src and dst
        # alive until the copy is done, exactly as the CUDA engine's deferred free does.
        self._deferred.append((ticket, (src, dst), None))
        self._d2h.jobs.put((weakref.ref(src), weakref.ref(dst), ticket, None))
        return ticket

    def fetch(self, src: torch.Tensor, after: Optional[CpuTicket]) -> tuple[torch.Tensor, CpuTicket]:
        dst = torch.empty(src.numel(), dtype=torch.uint8)
        return dst, self.fetch_into(src, dst, after)

    def fetch_into(self, src: torch.Tensor, dst: torch.Tensor,
                   after: Optional[CpuTicket]) -> CpuTicket:
        if self.clocked:
            return self._h2d.copy(dst, src, after)
        ticket = CpuTicket()
        self._deferred.append((ticket, (src, dst), None))
        self._h2d.jobs.put((weakref.ref(src), weakref.ref(dst), ticket, after))
        return ticket

    def wait(self, ticket: CpuTicket) -> bool:
        late = not ticket.done()
        if late:
            t0 = self.clock()
            ticket._block()
            self._stalls.append((self.stall_slot(), self.clock() - t0))
        if ticket.error:
            raise RuntimeError(f"chameleon-swap copy failed: {ticket.error}")
        return late

    def wait_host(self, ticket: CpuTicket) -> float:
        t0 = self.clock()
        ticket._block()
        if ticket.error is None:
            # The completions the wait let through are handled now, inside the wait (the
            # interface's contract): they are part of what the wait cost the step.
            self.poll()
        dt = self.clock() - t0
        self._stalls.append((self.stall_slot(), dt))
        if ticket.error:
            raise RuntimeError(f"chameleon-swap copy failed: {ticket.error}")
        return dt

    @contextlib.contextmanager
    def host_block(self):
        t0 = self.clock()
        try:
            yield
        finally:
            self._stalls.append((self.stall_slot(), self.clock() - t0))

    def defer(self, ticket: CpuTicket, fn: Optional[Callable[[], None]] = None,
              keep: object = None) -> None:
        self._deferred.append((ticket, keep, fn))
        if self.clocked:
            self._poll_at = min(self._poll_at, ticket.ready_at if ticket.error is None else 0.0)

    def poll(self) -> None:
        # The two workers finish out of order with each other, so scan the whole (short) list.
        if not self._deferred:
            return
        if self.clocked and time.perf_counter() < self._poll_at:
            return
        pending = deque()
        ready_fns = []
        while self._deferred:
            entry = self._deferred.popleft()
            if entry[0].done():
                if entry[2] is not None:
                    ready_fns.append(entry[2])
            else:
                pending.append(entry)
        self._deferred = pending
        if self.clocked:
            self._poll_at = min((e[0].ready_at for e in pending), default=float("inf"))
        for fn in ready_fns:
            fn()

    def synchronize(self) -> None:
        for ticket, _, _ in list(self._deferred):
            ticket._block()
        self.poll()

    def take_stalls(self) -> list[tuple[int, float]]:
        """This step's waits for copies, (slot, seconds) each, and forget them; step end only."""
        out, self._stalls = self._stalls, []
        return out

    def take_stall_seconds(self) -> float:
        return float(sum(s for _, s in self.take_stalls()))

    def take_link(self) -> dict:
        """Per direction, ``(bytes, seconds)`` the copy threads (or the link's clock) spent copying
        since last taken: the link's effective bandwidth as the steps saw it."""
        out = {}
        for name, w in (("d2h", self._d2h), ("h2d", self._h2d)):
            with w.lock:
                out[name], w.busy = tuple(w.busy), [0, 0.0]
        return out

    def take_cpu(self) -> float:
        """CPU seconds the copy threads spent on their copies since last taken (see the module
        docstring): part of what the step's moves cost. 0 on the link's clock, whose memmoves
        run on the calling thread, inside the moves it times."""
        out = 0.0
        for w in (self._d2h, self._h2d):
            with w.lock:
                out, w.cpu = out + w.cpu, 0.0
        return out

    def close(self) -> None:
        self.synchronize()
        _stop_workers(self._d2h, self._h2d)


def _stop_workers(*workers: _Worker) -> None:
    workers = tuple(w for w in workers if isinstance(w, _Worker))     # (a clocked link: none)
    for w in workers:
        if w.is_alive():
            w.jobs.put(None)
    # Join so no copy is still running inside torch when the interpreter tears down.
    for w in workers:
        if w.is_alive() and w is not threading.current_thread():
            w.join(timeout=5)

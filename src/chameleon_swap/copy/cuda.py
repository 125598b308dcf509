"""CUDA copy engine: one D2H and one H2D stream, ordered by events, with deferred frees.

Rules (docs/ARCHITECTURE.md; docs/LESSONS.md 1, 2, 3, 7):
* the D2H stream waits on an event recorded on the compute stream when the tensor was saved;
* a device tensor being copied out stays referenced here until its copy event has completed; then
  the compute stream waits on that (already complete) event before the reference is dropped, so the
  caching allocator and the CUDA sanitizer both see the copy ordered before the free. No
  ``record_stream``, which fragments the allocator;
* a fetch's destination is allocated on the compute stream (``fetch_into``: given, allocated or
  last used there), the H2D stream waits for that point and for the copy-out, and compute waits
  for the fetch's event before reading;
* completion is learnt by querying only the oldest pending event of each stream (copies on one
  stream finish in order), so polling costs at most two queries per call.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Callable, Optional

import torch


class CudaTicket:
    __slots__ = ("event", "stream_id", "_done")

    def __init__(self, event: torch.cuda.Event, stream_id: int) -> None:
        self.event = event
        self.stream_id = stream_id
        self._done = False

    def done(self) -> bool:
        if not self._done and self.event.query():
            self._done = True
        return self._done


class CudaCopyEngine:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        # Per stream, in issue order: (ticket, keep-alive object, callback).
        self._deferred = {0: deque(), 1: deque()}
        # (slot, before, after) per wait: events on the compute stream around it, read at step
        # end. A host wait is timed the same way: what the step lost is the compute stream's idle
        # time between the two events (none when the GPU still had queued work to run).
        self._stall_pairs: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        # () -> the profiler's current slot, asked at each wait; set by the engine.
        self.stall_slot: Callable[[], int] = lambda: -1

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def record_ready(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self._compute())
        return ev

    def offload(self, src: torch.Tensor, dst: torch.Tensor, ready: torch.cuda.Event) -> CudaTicket:
        self.d2h.wait_event(ready)
        with torch.cuda.stream(self.d2h):
            dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.d2h)
        ticket = CudaTicket(done, 0)
        self._deferred[0].append((ticket, (src, dst), None))
        return ticket

    def fetch(self, src: torch.Tensor, after: Optional[CudaTicket]) -> tuple[torch.Tensor, CudaTicket]:
        dst = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)  # compute-stream block
        return dst, self.fetch_into(src, dst, after)

    def fetch_into(self, src: torch.Tensor, dst: torch.Tensor,
                   after: Optional[CudaTicket]) -> CudaTicket:
        compute = self._compute()
        # dst was allocated (or last used) on the compute stream: the copy waits for that point.
        allocated = torch.cuda.Event()
        allocated.record(compute)
        self.h2d.wait_event(allocated)
        if after is not None:
            self.h2d.wait_event(after.event)   # copy-back strictly after copy-out
        with torch.cuda.stream(self.h2d):
            dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.h2d)
        ticket = CudaTicket(done, 1)
        # dst is the caller's from now on; only the host source needs keeping alive here.
        self._deferred[1].append((ticket, src, None))
        return ticket

    def wait(self, ticket: CudaTicket) -> bool:
        compute = self._compute()
        if ticket.done():
            compute.wait_event(ticket.event)  # free on the device; tells the sanitizer too
            return False
        before = torch.cuda.Event(enable_timing=True)
        after = torch.cuda.Event(enable_timing=True)
        before.record(compute)
        compute.wait_event(ticket.event)
        after.record(compute)
        # read at step end, never inside the step
        self._stall_pairs.append((self.stall_slot(), before, after))
        return True

    def wait_host(self, ticket: CudaTicket) -> float:
        compute = self._compute()
        before = torch.cuda.Event(enable_timing=True)
        after = torch.cuda.Event(enable_timing=True)
        before.record(compute)
        t0 = time.perf_counter()
        ticket.event.synchronize()
        ticket._done = True
        self.poll()                     # the completions the wait let through (see copy/)
        dt = time.perf_counter() - t0
        after.record(compute)
        self._stall_pairs.append((self.stall_slot(), before, after))
        return dt

    @contextlib.contextmanager
    def host_block(self):
        # The device's idle gap while this thread is blocked: ``before`` passes once the
        # compute stream has drained what was queued, ``after`` as soon as the thread queues
        # again. Pinning a new slab on this thread (about a second per GiB on the project's
        # H100 and H200) otherwise lands in the slot's compute, timed by the device: on the
        # H100 a first step that pinned 8 GiB read as 16 s of compute and its plans predicted
        # 12-50 s steps that ran in 0.3-0.6 s.
        compute = self._compute()
        before = torch.cuda.Event(enable_timing=True)
        before.record(compute)
        try:
            yield
        finally:
            after = torch.cuda.Event(enable_timing=True)
            after.record(compute)
            self._stall_pairs.append((self.stall_slot(), before, after))

    def defer(self, ticket: CudaTicket, fn: Optional[Callable[[], None]] = None,
              keep: object = None) -> None:
        self._deferred[ticket.stream_id].append((ticket, keep, fn))

    def poll(self) -> None:
        compute = None
        fns = []
        for q in self._deferred.values():
            while q and q[0][0].done():
                ticket, keep, fn = q.popleft()
                if keep is not None:
                    compute = compute or self._compute()
                    compute.wait_event(ticket.event)
                if fn is not None:
                    fns.append(fn)
        for fn in fns:
            fn()

    def synchronize(self) -> None:
        self.d2h.synchronize()
        self.h2d.synchronize()
        for q in self._deferred.values():
            for ticket, _, _ in q:
                ticket._done = True
        self.poll()

    def take_stalls(self) -> list[tuple[int, float]]:
        """(slot, seconds) per wait of this step: the compute stream's time lost on late copies
        and host waits; step end only."""
        out = []
        for slot, before, after in self._stall_pairs:
            after.synchronize()
            out.append((slot, before.elapsed_time(after) / 1000.0))
        self._stall_pairs.clear()
        return out

    def take_stall_seconds(self) -> float:
        return float(sum(s for _, s in self.take_stalls()))

    def take_link(self) -> dict:
        """Copies are not timed one by one on CUDA (no events beyond those ordering them):
        nothing measured; the engine fits the link from the stalls instead."""
        return {}

    def take_cpu(self) -> float:
        """No copy threads: the copy engines of the GPU move the bytes."""
        return 0.0

    def close(self) -> None:
        self.synchronize()

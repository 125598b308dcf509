"""Host buffers for offloaded storages: size-classed, reused across steps, bounded.

A fresh pinned allocation costs milliseconds (LESSONS 8), so buffers are kept in free lists by
size class and handed out again in later steps. The pool never holds more than ``limit_bytes``
(buffers in use plus cached free ones); when a request cannot fit even after dropping every cached
buffer it raises :class:`HostMemoryError`, naming the limit, instead of stalling or crashing.
"""
from __future__ import annotations

import threading
from collections import defaultdict

import torch

from ..config import format_bytes


_allocating = threading.local()


def allocating_host() -> bool:
    """True on this thread while the pool allocates a host buffer. On a CPU device, host and
    device are the same RAM: tools that meter device memory (``bench.meter``) read this to leave
    host buffers out, as they would be on a GPU."""
    return getattr(_allocating, "on", False)


class HostMemoryError(RuntimeError):
    """The host buffer pool cannot hold another offloaded tensor within ``host_memory_limit``."""


def size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to one of four classes per power of two (at most 25% waste), min 4 KiB."""
    if nbytes <= 4096:
        return 4096
    top = 1 << (nbytes - 1).bit_length()   # smallest power of two >= nbytes
    step = top // 8                        # classes at 5/8, 6/8, 7/8, 8/8 of top
    return -(-nbytes // step) * step


class HostBuffer:
    """One host allocation; ``view(nbytes)`` is the uint8 prefix a storage is copied into."""

    __slots__ = ("tensor", "capacity")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.capacity = tensor.numel()

    def view(self, nbytes: int) -> torch.Tensor:
        return self.tensor[:nbytes]


class HostPool:
    def __init__(self, limit_bytes: int, *, pin: bool) -> None:
        self.limit_bytes = int(limit_bytes)
        self.pin = pin
        self._free: dict[int, list[HostBuffer]] = defaultdict(list)
        self._lock = threading.Lock()
        self.in_use_bytes = 0      # capacity of buffers handed out and not yet returned
        self.cached_bytes = 0      # capacity of buffers waiting in free lists
        self.peak_in_use_bytes = 0
        self.allocations = 0       # fresh allocations (a high count means the pool is not reused)

    @property
    def reserved_bytes(self) -> int:
        return self.in_use_bytes + self.cached_bytes

    def acquire(self, nbytes: int) -> HostBuffer:
        cls = size_class(nbytes)
        with self._lock:
            free = self._free.get(cls)
            if free:
                buf = free.pop()
                self.cached_bytes -= cls
            else:
                if self.in_use_bytes + cls > self.limit_bytes:
                    raise HostMemoryError(
                        f"host_memory_limit reached: {format_bytes(self.in_use_bytes)} of host memory "
                        f"already hold offloaded activations and {format_bytes(cls)} more are needed, "
                        f"over host_memory_limit={format_bytes(self.limit_bytes)}. Raise "
                        f"host_memory_limit, raise the device budget, or shrink the step.")
                self._trim_locked(self.limit_bytes - cls)
                _allocating.on = True
                try:
                    buf = HostBuffer(torch.empty(cls, dtype=torch.uint8, pin_memory=self.pin))
                finally:
                    _allocating.on = False
                self.allocations += 1
            self.in_use_bytes += cls
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
            return buf

    def release(self, buf: HostBuffer) -> None:
        with self._lock:
            self.in_use_bytes -= buf.capacity
            if self.reserved_bytes + buf.capacity <= self.limit_bytes:
                self._free[buf.capacity].append(buf)
                self.cached_bytes += buf.capacity

    def _trim_locked(self, target_reserved: int) -> None:
        """Drop cached buffers, largest class first, until reserved bytes <= target."""
        for cls in sorted(self._free, reverse=True):
            bufs = self._free[cls]
            while bufs and self.reserved_bytes > target_reserved:
                bufs.pop()
                self.cached_bytes -= cls
        self._free = defaultdict(list, {c: b for c, b in self._free.items() if b})

    def clear(self) -> None:
        """Return every cached buffer to the system (buffers in use are untouched)."""
        with self._lock:
            self._trim_locked(self.in_use_bytes)

"""Swap everything, asynchronously: the peer baseline of "offload every activation" tools.

What torchtune's ``OffloadActivations`` does (read in torchtune 0.6.1,
``torchtune/training/_activation_offloading.py``): every saved tensor of at least 1024 bytes that
is not a Parameter or Buffer is copied to pinned host memory on a side stream right after it is
saved, and copied back when backward unpacks it. It needs CUDA (it asks for CUDA streams when
created) and torchao, so where it cannot run this is our own equivalent, labelled as such in every
result. Ours is, if anything, a stronger peer: host buffers come from a reused arena (torchtune
allocates fresh pinned memory per tensor) and the next tensor in reverse save order is prefetched
when one is unpacked.

It knows no budget: everything moves, nothing is planned. Per saved *tensor* (no storage dedup,
as in the peer), strides kept, so gradients stay bitwise; parameters, leaves that require grad and
tensors that are not dense and non-overlapping stay on the device.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Optional

import torch

from ..copy.host_pool import HostBuffer, HostPool

MIN_OFFLOAD_BYTES = 1024     # torchtune's default min_offload_size


class _Saved:
    __slots__ = ("size", "stride", "dtype", "host", "host_t", "device_t", "out_done", "back",
                 "back_done", "index", "used")

    def __init__(self, t: torch.Tensor, index: int) -> None:
        self.size, self.stride, self.dtype = t.size(), t.stride(), t.dtype
        self.index = index
        self.host: Optional[HostBuffer] = None
        self.host_t: Optional[torch.Tensor] = None
        self.device_t: Optional[torch.Tensor] = t      # kept until the copy out completed
        self.out_done = None                           # CUDA event of the copy out
        self.back: Optional[torch.Tensor] = None       # device copy brought back
        self.back_done = None
        self.used = False                              # unpacked once: never prefetched again


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: some permutation of ``t`` is contiguous (a transpose is; an
    expanded or strided slice is not). Such a tensor fills exactly its strided footprint."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.size(), t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _span(t: torch.Tensor) -> int:
    """Elements between the first and the last one ``t`` addresses (its strided footprint)."""
    return 1 + sum((s - 1) * st for s, st in zip(t.size(), t.stride()) if s > 0) if t.numel() else 0


class SwapAll:
    """Saved-tensor hooks that move every activation to host and back. ``with swap.step(): ...``
    around one forward and backward; counters per step in ``moved_bytes``/``fetched_bytes``."""

    def __init__(self, device: torch.device, host_limit_bytes: int) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pool = HostPool(host_limit_bytes, pin=self.cuda)
        if self.cuda:
            self.d2h = torch.cuda.Stream(self.device)
            self.h2d = torch.cuda.Stream(self.device)
        self._saved: list[_Saved] = []
        self._going: deque[_Saved] = deque()         # copies out in flight, oldest first (FIFO)
        self.moved_bytes = 0
        self.fetched_bytes = 0

    @contextlib.contextmanager
    def step(self):
        self._saved = []
        self.moved_bytes = self.fetched_bytes = 0
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            if self.cuda:
                torch.cuda.current_stream(self.device).synchronize()
            for s in self._saved:
                self._free(s)
            self._saved = []
            self._going.clear()

    def _free(self, s: _Saved) -> None:
        if s.host is not None:
            self.pool.release(s.host)
            s.host = s.host_t = None
        s.device_t = s.back = None

    # ------------------------------------------------------------------ forward
    def _pack(self, t: torch.Tensor):
        base = t if t._base is None else t._base
        if (t.device != self.device or type(t) is not torch.Tensor or t.layout != torch.strided
                or isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)
                or t.nbytes < MIN_OFFLOAD_BYTES or not _dense(t)):
            return t
        s = _Saved(t, len(self._saved))
        n = _span(t)
        s.host = self.pool.acquire(n * t.element_size())
        s.host_t = torch.as_strided(s.host.view(n * t.element_size()).view(t.dtype), t.size(),
                                    t.stride())
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            self.d2h.wait_event(ready)
            with torch.cuda.stream(self.d2h):
                s.host_t.copy_(t, non_blocking=True)
            s.out_done = torch.cuda.Event()
            s.out_done.record(self.d2h)
            self._going.append(s)
            self._release_done()
        else:
            s.host_t.copy_(t)
            s.device_t = None
        self.moved_bytes += t.nbytes
        self._saved.append(s)
        return s

    def _release_done(self) -> None:
        """Drop device tensors whose copy out has completed (freed after the compute stream
        waits on the finished copy, so the allocator sees the order)."""
        compute = torch.cuda.current_stream(self.device)
        while self._going and self._going[0].out_done.query():   # one stream: done in order
            s = self._going.popleft()
            compute.wait_event(s.out_done)
            s.device_t = None

    # ------------------------------------------------------------------ backward
    def _fetch(self, s: _Saved) -> None:
        if s.back is not None or s.host_t is None:
            return
        s.back = torch.empty_strided(s.size, s.stride, dtype=s.dtype, device=self.device)
        if self.cuda:
            allocated = torch.cuda.Event()
            allocated.record(torch.cuda.current_stream(self.device))
            self.h2d.wait_event(allocated)
            self.h2d.wait_event(s.out_done)            # back strictly after out
            with torch.cuda.stream(self.h2d):
                s.back.copy_(s.host_t, non_blocking=True)
            s.back_done = torch.cuda.Event()
            s.back_done.record(self.h2d)
        else:
            s.back.copy_(s.host_t)
        self.fetched_bytes += s.back.nbytes

    def _unpack(self, s):
        if not isinstance(s, _Saved):
            return s
        if s.device_t is not None:                     # copy out not known complete: use it
            return s.device_t
        self._fetch(s)
        s.used = True
        if s.index > 0 and not self._saved[s.index - 1].used:   # likely needed next
            self._fetch(self._saved[s.index - 1])
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(s.back_done)
        # Autograd holds the tensor for as long as the node needs it; holding it here as well
        # would keep every activation on the device until the step ends.
        t, s.back = s.back, None
        return t

    def close(self) -> None:
        self.pool.close()

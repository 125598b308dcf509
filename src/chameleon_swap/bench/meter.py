"""Device memory a step allocates and holds, for every baseline alike, on any device.

On CUDA the caching allocator keeps the books (``max_memory_allocated``). On the CPU nothing does,
and the baselines hide their memory in different places: checkpointing keeps its boundary inputs in
closures and its recomputed tensors in private holders, where saved-tensor hooks cannot see them.
So the meter sits below autograd, as a ``TorchDispatchMode``: every op that allocates a new
storage on the metered device adds its bytes until that storage dies (a weak reference's callback).

What counts is what a step allocates: storages created by out-of-place, non-view ops while the
meter is on. Views and in-place writes into storages that existed before (the host arena's reused
buffers, parameters) are not new memory and are not counted; nor are the slabs the host arena
allocates (``copy.host_pool.allocating_host``), which on a CPU device share the RAM with the
"device" but stand for host memory. The result is the step's memory above
what was allocated when it began, the CPU analogue of ``max_memory_allocated`` minus
``memory_allocated`` at the start.

The meter costs Python time on every op (about 40% of a small CPU step), so the harness never
times a metered step.
"""
from __future__ import annotations

import time
import weakref
from typing import Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..copy.host_pool import allocating_host


class MemoryMeter(TorchDispatchMode):
    """Peak and curve of the bytes allocated on ``device`` while active and still alive.

    Use one meter per step::

        with MemoryMeter(device) as m:
            ...forward and backward...
        m.peak_bytes, m.curve      # curve: [(seconds since start, live bytes, saved bytes)]

    With ``budgets``, the meter also counts the saved activations among those bytes (through
    saved-tensor hooks that change nothing: use it on a run without other hooks) and computes,
    for each budget B, ``caps[B]``: the most memory the step would have needed had its saved
    activations been held to B at every moment, ``max over t of live - saved + min(saved, B)``.
    That is what an ideal swapper, with free copies, would need; no baseline can need less by
    moving activations.
    """

    def __init__(self, device: torch.device, *, record_curve: bool = True,
                 budgets: Sequence[int] = ()) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.saved_bytes = 0
        self.largest_saved_bytes = 0        # the largest storage saved for backward
        self.allocations = 0
        self.curve: Optional[list] = [] if record_curve else None
        self.budgets = tuple(budgets)
        self.caps = {b: 0 for b in self.budgets}
        self._seen: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # storage -> [saved]
        self._hooks = (torch.autograd.graph.saved_tensors_hooks(self._pack, _identity)
                       if self.budgets else None)
        self._t0 = 0.0
        self._active = False

    def __enter__(self) -> "MemoryMeter":
        self._t0 = time.perf_counter()
        self._active = True
        self._point()
        if self._hooks is not None:
            self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
        self._active = False
        self._point()

    def _point(self) -> None:
        live, saved = self.live_bytes, self.saved_bytes
        for b in self.budgets:
            need = live - saved + (saved if saved < b else b)
            if need > self.caps[b]:
                self.caps[b] = need
        if self.curve is not None:
            self.curve.append((time.perf_counter() - self._t0, live, saved))

    def _freed(self, nbytes: int, saved: list) -> None:
        self.live_bytes -= nbytes
        if saved[0]:
            self.saved_bytes -= nbytes
        if self._active:
            self._point()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # Only storages this step allocated: parameters and inputs are not activations here.
        if t.device == self.device:
            flag = self._seen.get(t.untyped_storage())
            if flag is not None and not flag[0]:
                flag[0] = True
                n = t.untyped_storage().nbytes()
                self.saved_bytes += n
                self.largest_saved_bytes = max(self.largest_saved_bytes, n)
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable or allocating_host():
            return out                      # no new device storage: a view, in place, or host
        inputs = None
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device != self.device:
                continue
            s = t.untyped_storage()
            if s in self._seen:
                continue
            if inputs is None:              # an output aliasing an input is not new memory
                inputs = {a.untyped_storage()._cdata for a in tree_leaves((args, kwargs))
                          if isinstance(a, torch.Tensor) and a.device == self.device}
            if s._cdata in inputs:          # (all alive now: the pointers cannot be reused)
                continue
            n = s.nbytes()
            flag = [False]
            self._seen[s] = flag
            weakref.finalize(s, self._freed, n, flag)
            self.allocations += 1
            self.live_bytes += n
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
            self._point()
        return out


def _identity(x):
    return x

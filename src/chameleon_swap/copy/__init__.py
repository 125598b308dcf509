"""Copy engines: move storage bytes device->host and back, asynchronously, and say when done.

Both backends offer the same small interface, so the executor above them is identical on CPU and
CUDA and ordering bugs show in the CPU tests:

``record_ready()``
    called when a tensor is saved in a step with a budget; marks the point after which its bytes
    are final (a CUDA event on the compute stream; nothing on CPU, where compute is synchronous).
    With no budget nothing can move, and neither this nor any other method is called per save.
``offload(src, dst, ready) -> Ticket``
    copy ``src`` (device uint8) into ``dst`` (host uint8) once ``ready`` has passed. The engine keeps
    ``src`` alive until the copy has completed (deferred free), so the caller may drop it at once.
``fetch(src, after) -> (device uint8, Ticket)``
    copy host bytes into a new device tensor, ordered after ticket ``after`` (the copy-out).
``fetch_into(src, dst, after) -> Ticket``
    the same into a device uint8 tensor the caller allocated on the compute stream (weight
    offload brings parameters back into their own storages); the caller keeps ``dst`` alive.
``wait(ticket) -> bool``
    make compute wait for a fetch before its bytes are read; True if it had not completed yet.
``wait_host(ticket)``
    block the calling thread until a copy has completed (only when the budget forces it), then
    handle the completions the wait let through (``poll()``), inside the wait's time.
``defer(ticket, fn=None, keep=None)``
    once ``ticket`` has completed, drop ``keep`` (a device tensor that must outlive the copy) and
    call ``fn``, from a later ``poll()`` on the caller's thread.
``poll()``, ``synchronize()``
``take_link() -> {"d2h": (bytes, seconds), "h2d": ...}``
    at step end: what the copies of the step moved and how long they took, per direction, where
    the backend times them (CPU); ``{}`` where it does not (CUDA).
``take_cpu() -> float``
    at step end: CPU seconds the backend's own threads spent copying since last taken (CPU:
    its two workers; 0.0 on CUDA, whose copies take no host thread).
``host_block()``
    a context manager around work that blocks the calling thread without computing (the host
    arena allocating, on CUDA pinning, memory for a copy-out): counted as a wait of the step,
    as the compute stream sees it (on CUDA the device's idle gap, timed by events).
``take_stalls() -> [(slot, seconds)]``, ``take_stall_seconds()``
    at step end: each wait of the step (``wait`` that found its copy late, ``wait_host``,
    ``host_block``) with the
    slot it fell in, as the engine's ``stall_slot()`` callable said when it happened (called
    exactly once per wait, in the order of the list: the profiler counts waits by it); the
    profiler keeps those seconds apart from the slot's compute (a stalled step must plan like a
    clean one), and the recompute runner apart from its recomputes' times.

May import: ``config`` only. It moves bytes and knows nothing of tensors' meaning.
Imported by: ``runtime/`` (the executor), ``engine.py``, ``parallel/`` and the tools.
"""
from __future__ import annotations

from typing import Callable, ContextManager, Optional, Protocol

import torch


class Ticket(Protocol):
    def done(self) -> bool: ...


class CopyEngine(Protocol):
    device: torch.device

    def record_ready(self) -> object: ...
    def offload(self, src: torch.Tensor, dst: torch.Tensor, ready: object) -> Ticket: ...
    def fetch(self, src: torch.Tensor, after: Optional[Ticket]) -> tuple[torch.Tensor, Ticket]: ...
    def fetch_into(self, src: torch.Tensor, dst: torch.Tensor,
                   after: Optional[Ticket]) -> Ticket: ...
    def wait(self, ticket: Ticket) -> bool: ...
    def wait_host(self, ticket: Ticket) -> float: ...
    def host_block(self) -> ContextManager[None]: ...
    def defer(self, ticket: Ticket, fn: Optional[Callable[[], None]] = None,
              keep: object = None) -> None: ...
    def poll(self) -> None: ...
    def synchronize(self) -> None: ...
    stall_slot: Callable[[], int]
    def take_stalls(self) -> list[tuple[int, float]]: ...
    def take_stall_seconds(self) -> float: ...
    def take_link(self) -> dict: ...
    def take_cpu(self) -> float: ...
    def close(self) -> None: ...


def make_copy_engine(device: torch.device, **kwargs) -> CopyEngine:
    if device.type == "cuda":
        from .cuda import CudaCopyEngine
        return CudaCopyEngine(device)
    if device.type == "cpu":
        from .cpu import CpuCopyEngine
        return CpuCopyEngine(**kwargs)
    raise ValueError(f"device must be a 'cpu' or 'cuda' device; got {device}")

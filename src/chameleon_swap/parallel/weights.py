"""Weight offload: a model's blocks keep their parameters in host memory between uses, so a stage
holding more layers than fit needs the device for about two blocks' weights during a step.

Mechanism only; the one decision is "the next block" (forward order in forward, reverse in
backward). Per step of :class:`WeightOffload`:

* at the step's start every block's parameters are copied to its host buffer (pinned on CUDA,
  allocated once), ordered after whatever last wrote them (the optimizer step): one copy-out per
  step, since weights do not change inside a step;
* a block's forward pre-hook makes sure its weights are on the device (compute waits for the
  copy: a stream event on CUDA, the worker's ticket on CPU) and starts bringing back the next
  block's; its forward hook releases them, and arms a hook on the block's outputs that fetches
  them again, and prefetches the previous block's, when the gradient reaches the block;
* after backward, a block is released once every parameter's gradient has accumulated
  (``register_post_accumulate_grad_hook``); a block with frozen parameters (they are read by
  backward but never get a gradient) or with parameters this pass did not use is released when
  the gradient reaches another block, or by :meth:`WeightOffload.release_idle`;
* at the step's end (an exception included) every parameter is back where it was: between steps
  the optimizer and the user see a plain model.

Releasing frees the parameter's storage (``untyped_storage().resize_(0)``), so tensors autograd
saved (the parameter itself, ``weight.t()`` and other views, the activation engine's handles)
hold no device memory, and fetching refills the same storage, so every one of them sees the
weights again. The parameter's ``.data`` is swapped for an empty tensor meanwhile: a forward that
reaches it without a fetch fails with a shape error instead of reading freed memory. Nothing is
rounded or recomputed: gradients are bit-for-bit those without offload.

A backward may also read a block's weights before the gradient of any of the block's outputs is
ready: through a tensor made inside the block and used outside it (an auxiliary loss kept on the
module, say). A released storage must never be read (it has no memory: a crash, not an error),
so during a block's forward the offload wraps the saved-tensor hooks in force (the activation
engine's, a checkpoint's, or none) with its own: every tensor the block saves is packed by the
hooks underneath as before, and one that shares a storage with an offloaded parameter is marked
with its block; when autograd unpacks it, the block is brought back first (``sync_fetches``).

Not supported (refused with an error): parameters shared between blocks, or between a block and
the rest of ``model``.

Why one file (over 400 lines): weight offload is one mechanism with one per-block state (where a
block's parameters are, which copy is in flight, which hooks bring them back for forward, for
backward and for a recompute). Its parts would only import each other's private state.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator, Optional

import torch
import torch.nn as nn

from ..recompute.blocks import _check_disjoint, check_unshared
from ..copy import CopyEngine, make_copy_engine
from ..copy.host_pool import align_up
from ..runtime._eager import is_compiling as _is_compiling
from ..runtime._eager import top_saved_hooks as _top_hooks

HOST, FETCHING, RESIDENT = "host", "fetching", "resident"


@dataclasses.dataclass
class WeightStepStats:
    """What one step of :class:`WeightOffload` did."""

    peak_bytes: int = 0         # most weight bytes on the device from the first block on
    peak_held_bytes: int = 0    # of which: blocks fetched or run in this step, at most two
                                # (the rest: blocks still there from the step's start while
                                # their copy-out runs; each goes as soon as it has finished)
    offloaded_bytes: int = 0    # copied device -> host at the step's start
    fetched_bytes: int = 0      # copied host -> device (prefetches and on-demand fetches)
    sync_fetches: int = 0       # blocks needed before a prefetch had started
    stall_seconds: float = 0.0  # compute time lost waiting for weight copies
    failed: bool = False


class _Block:
    __slots__ = ("index", "params", "storages", "host", "nbytes", "state", "out", "inn",
                 "aliases", "hooked", "expected", "accumulated", "in_forward", "used", "pushed")

    def __init__(self, index: int, params: list) -> None:
        self.index = index
        self.params = params
        self.storages: list = []          # distinct storages of the parameters
        self.host: list = []              # one host uint8 buffer per storage
        self.nbytes = 0
        self.state = RESIDENT
        self.out: list = []               # tickets of this step's copy-out
        self.inn: list = []               # tickets of the fetch under way
        self.aliases: list = []           # each parameter's .data while it is released
        # Release after backward by counting gradients only when every parameter gets one.
        self.hooked = all(p.requires_grad for p in params)
        self.expected = len(params) if self.hooked else None
        self.accumulated = 0
        self.in_forward = 0
        self.used = False                 # fetched or run in this step
        self.pushed: list = []            # saved-tensor hooks pushed by this block's forwards


class WeightOffload:
    """Keep the parameters of ``blocks`` in host memory between their uses inside a step.

    Args:
        blocks: the model's repeated blocks (see :func:`chameleon_swap.recompute.blocks.find_blocks`),
            distinct, none inside another, in forward order.
        device: the device the parameters live on; default: that of the first parameter.
        copy: a copy engine to share (``chameleon_swap.copy``); default: one of its own.
        model: the module holding the blocks; when given, a parameter a block shares with the
            rest of it is refused (it would be released while the rest still uses it).

    Use ``with off.step():`` around one forward and backward, or ``begin_step`` /
    ``end_step``. ``off.last_step`` is a :class:`WeightStepStats`.
    """

    def __init__(self, blocks, *, device=None, copy: Optional[CopyEngine] = None,
                 model: Optional[nn.Module] = None) -> None:
        if isinstance(blocks, nn.Module) and not isinstance(blocks, nn.ModuleList):
            raise TypeError("blocks must be a list of nn.Module blocks (use "
                            "chameleon_swap.recompute.blocks.find_blocks(model)); got one "
                            f"{type(blocks).__name__}")
        blocks = list(blocks)
        if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
            raise TypeError("blocks must be a non-empty list of nn.Module blocks")
        _check_disjoint(blocks)
        check_unshared(blocks, model)
        self.device = self._device(blocks, device)
        self._blocks = [_Block(i, list(b.parameters())) for i, b in enumerate(blocks)]
        self.model = model
        self._own_copy = copy is None
        self.copy = make_copy_engine(self.device) if copy is None else copy
        self._pin = self.device.type == "cuda"
        self._lock = threading.RLock()
        self._in_step = False
        self._step_id = 0
        self.resident_bytes = 0             # weight bytes of the blocks on the device
        self.held_bytes = 0                 # of which: blocks fetched or run in this step
        self.last_step: Optional[WeightStepStats] = None
        self._stats = WeightStepStats()
        self._owner: dict = {}              # id(storage) -> (storage, its block)
        for b in self._blocks:
            self._layout(b)
            self.resident_bytes += b.nbytes
        self._hooks = []
        for b, m in zip(self._blocks, blocks):
            self._hooks.append(m.register_forward_pre_hook(self._make_pre(b)))
            self._hooks.append(m.register_forward_hook(self._make_post(b), always_call=True))
            for p in b.params:
                if p.requires_grad:
                    self._hooks.append(p.register_hook(self._make_grad_arrives(b)))
            if b.hooked:
                for p in b.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._make_acc(b)))

    @staticmethod
    def _device(blocks, device) -> torch.device:
        params = [p for b in blocks for p in b.parameters()]
        if not params:
            raise ValueError("blocks hold no parameters: nothing to offload")
        dev = torch.device(device) if device is not None else params[0].device
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        for p in params:
            if p.device != dev:
                raise ValueError(f"device={dev}: every block parameter must be on it; one is on "
                                 f"{p.device}")
        return dev

    @property
    def block_bytes(self) -> list[int]:
        """Device bytes of each block's parameters (their storages)."""
        return [b.nbytes for b in self._blocks]

    def _layout(self, b: _Block) -> None:
        """The block's storages (read again each step: the user may have replaced them) and a
        host buffer for each, allocated (pinned on CUDA) only when the sizes change."""
        storages, seen = [], set()
        for p in b.params:
            if p.layout != torch.strided or p.device != self.device or type(p.data) is not \
                    torch.Tensor:
                raise ValueError(f"weight offload needs plain strided parameters on "
                                 f"{self.device}; block {b.index} has a {type(p.data).__name__} "
                                 f"({p.layout}) on {p.device} (tensor subclasses such as DTensor "
                                 "are not supported)")
            s = p.untyped_storage()
            if id(s) not in seen:
                if not s.resizable():
                    raise ValueError(f"block {b.index} has a parameter whose storage cannot be "
                                     "resized (memory torch does not own): it cannot be released")
                seen.add(id(s))
                storages.append(s)
        for old in b.storages:
            self._owner.pop(id(old), None)
        for st in storages:
            self._owner[id(st)] = (st, b)
        sizes = [s.nbytes() for s in storages]
        if [h.numel() for h in b.host] != sizes:
            b.host = self._host_buffers(sizes)
        b.storages, b.nbytes = storages, sum(sizes)

    def _host_buffers(self, sizes: list[int]) -> list[torch.Tensor]:
        # One allocation per block, each storage on its own page: pinned once, reused every step.
        flat = torch.empty(sum(align_up(n) for n in sizes), dtype=torch.uint8, pin_memory=self._pin)
        out, at = [], 0
        for n in sizes:
            out.append(flat[at:at + n])
            at += align_up(n)
        return out

    # ------------------------------------------------------------------ the step
    @contextlib.contextmanager
    def step(self) -> Iterator["WeightOffload"]:
        """One forward and backward with the blocks' weights offloaded between uses."""
        self.begin_step()
        failed = False
        try:
            yield self
        except BaseException:
            failed = True
            raise
        finally:
            self.end_step(failed)

    def begin_step(self) -> None:
        with self._lock:
            if self._in_step:
                raise RuntimeError("WeightOffload.begin_step(): a step is already under way; "
                                   "end it first")
            self._step_id += 1
            self._stats = WeightStepStats()
            self.held_bytes = 0
            for b in self._blocks:
                self._layout(b)
                srcs = [_bytes(s) for s in b.storages]
                # After the optimizer's last write, and after the byte views: ``set_`` counts as
                # a write to the CUDA sanitizer, so the copy must wait on an event recorded
                # after it (issue 19).
                ready = self.copy.record_ready()
                b.out = [self.copy.offload(src, h, ready) for src, h in zip(srcs, b.host)]
                b.state, b.used, b.in_forward, b.accumulated = RESIDENT, False, 0, 0
                # Freezing or unfreezing between steps changes what backward accumulates.
                b.expected = (len(b.params) if b.hooked and all(p.requires_grad for p in b.params)
                              else None)
                self._stats.offloaded_bytes += b.nbytes
            self._in_step = True

    def end_step(self, failed: bool = False) -> None:
        """Bring every parameter back (also after an exception) and close the step's figures."""
        with self._lock:
            if not self._in_step:
                return
            self._in_step = False
            try:
                for b in self._blocks:
                    if b.state == HOST:
                        self._fetch(b)
                for b in self._blocks:
                    self._settle(b)       # compute waits for the copies: the optimizer is after
            finally:
                for b in self._blocks:
                    if b.state != RESIDENT:      # a copy failed: keep the model whole anyway
                        self._restore_anyway(b)
                self.copy.poll()
                self._stats.stall_seconds = self.copy.take_stall_seconds()
                self._stats.failed = failed
                self.last_step = self._stats

    def release_idle(self) -> None:
        """Release every block not running a forward now (say, once a stage's backward is done:
        the first block, released otherwise only when the gradient reaches another block)."""
        with self._lock:
            if self._in_step:
                self._release_others(keep=(), wait_leaving=True)

    def close(self) -> None:
        """End a step under way, remove every hook; the model is left as without offload."""
        self.end_step(failed=True)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._own_copy:
            self.copy.close()

    # ------------------------------------------------------------------ moves
    def _fetch(self, b: _Block) -> None:
        """Refill the block's storages on the compute stream and copy its host bytes in."""
        b.inn = []
        for s, h, out in zip(b.storages, b.host, b.out):
            s.resize_(h.numel())
            b.inn.append(self.copy.fetch_into(h, _bytes(s), out))
        b.state = FETCHING
        b.used = True
        self._stats.fetched_bytes += b.nbytes
        self.resident_bytes += b.nbytes
        self.held_bytes += b.nbytes
        self._sample()

    def _settle(self, b: _Block) -> None:
        """Make compute wait for the block's fetch, then give the parameters their data back."""
        if b.state != FETCHING:
            return
        for t in b.inn:
            self.copy.wait(t)
        b.inn = []
        for p, alias in zip(b.params, b.aliases):
            p.data = alias
        b.aliases = []
        b.state = RESIDENT

    def _restore_anyway(self, b: _Block) -> None:
        """After a failed copy: refill the block from its host copy synchronously."""
        self.copy.synchronize()
        if b.state == HOST:
            self.resident_bytes += b.nbytes
        for s, h in zip(b.storages, b.host):
            s.resize_(h.numel())
            _bytes(s).copy_(h)
        for p, alias in zip(b.params, b.aliases):
            p.data = alias
        b.aliases, b.inn, b.state = [], [], RESIDENT

    def _ensure(self, b: _Block) -> None:
        if b.state == HOST:
            self._stats.sync_fetches += 1
            self._fetch(b)
        self._settle(b)
        if not b.used:                      # still here from the step's start
            b.used = True
            self.held_bytes += b.nbytes

    def _prefetch(self, i: int) -> None:
        if 0 <= i < len(self._blocks) and self._blocks[i].state == HOST:
            self._fetch(self._blocks[i])

    def _release(self, b: _Block) -> None:
        """Free the block's device copy: no copy-out is needed, the host copy is this step's."""
        if b.state == HOST:
            return
        self._settle(b)                     # a prefetch still under way finishes first
        for t in b.out:
            self.copy.wait(t)               # the copy-out read these bytes: free after it
        b.aliases = [p.data for p in b.params]
        for p in b.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        for s in b.storages:
            s.resize_(0)
        b.state = HOST
        self.resident_bytes -= b.nbytes
        if b.used:
            self.held_bytes -= b.nbytes

    def _release_others(self, keep, wait_leaving: bool) -> None:
        """Release resident blocks outside ``keep`` and not running a forward. Blocks still
        resident from the step's start whose copy-out has not finished are left until it has
        (no stall for them) unless ``wait_leaving``."""
        for b in self._blocks:
            if b.state == HOST or b.index in keep or b.in_forward:
                continue
            if not wait_leaving and not b.used and not all(t.done() for t in b.out):
                continue
            self._release(b)

    def _sample(self) -> None:
        # Inside the step only: the end's restore brings the whole model back by design.
        if self._in_step:
            st = self._stats
            st.peak_bytes = max(st.peak_bytes, self.resident_bytes)
            st.peak_held_bytes = max(st.peak_held_bytes, self.held_bytes)

    # ------------------------------------------------------------------ hooks
    def _active(self) -> bool:
        return self._in_step and not _is_compiling()

    def _make_pre(self, b: _Block):
        def pre(module, args):
            if not self._active():
                return
            with self._lock:
                self.copy.poll()
                if _in_backward():             # a recompute inside backward: weights are here
                    self._ensure(b)
                    b.in_forward += 1
                    return
                self._release_others(keep=(b.index, b.index + 1), wait_leaving=False)
                self._ensure(b)
                b.in_forward += 1
                self._prefetch(b.index + 1)
                self._sample()
            if torch.is_grad_enabled():
                b.pushed.append(self._push_saved_hooks())
        return pre

    def _make_post(self, b: _Block):
        def post(module, args, output):
            if b.pushed:                       # always_call: also after a failed forward
                b.pushed.pop().__exit__(None, None, None)
            if not self._in_step:
                return
            with self._lock:
                b.in_forward = max(0, b.in_forward - 1)
                if _in_backward() or _is_compiling():
                    return
                if torch.is_grad_enabled():
                    step = self._step_id
                    for t in _grad_outputs(output):
                        t.register_hook(self._make_backward(b, step))
                if not b.in_forward:
                    self._release(b)
        return post

    def _push_saved_hooks(self):
        """Wrap the saved-tensor hooks in force (those underneath pack and unpack everything as
        before) so that a saved tensor sharing a storage with an offloaded parameter brings its
        block back when autograd unpacks it, whenever that is."""
        top = _top_hooks(False) if _top_hooks is not None else None
        below_pack, below_unpack = top if top is not None else (None, None)
        owner = self._owner

        def pack(t):
            found = owner.get(id(t.untyped_storage()))
            inner = below_pack(t) if below_pack is not None else t
            return _Saved((found[1] if found is not None else None, inner))

        def unpack(h):
            b, inner = h
            if b is not None and b.state != RESIDENT and self._in_step:
                with self._lock:
                    self._ensure(b)            # read outside the block's own backward
                    self._sample()
            return below_unpack(inner) if below_unpack is not None else inner

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        return hooks

    def _make_backward(self, b: _Block, step: int):
        def begins(grad):
            # The gradient reached one of the block's outputs: its backward is next.
            if self._in_step and step == self._step_id:
                with self._lock:
                    self.copy.poll()
                    self._release_others(keep=(b.index, b.index - 1), wait_leaving=True)
                    self._ensure(b)
                    b.accumulated = 0
                    self._prefetch(b.index - 1)
                    self._sample()
            return None
        return begins

    def _make_grad_arrives(self, b: _Block):
        def arrives(grad):
            # A parameter's gradient is about to accumulate: its block must be whole (the
            # accumulation reads the parameter's layout), even if no hook on the block's outputs
            # saw its backward begin (an output the offload cannot look into).
            if self._in_step and b.state != RESIDENT:
                with self._lock:
                    self._ensure(b)
                    self._sample()
            return None
        return arrives

    def _make_acc(self, b: _Block):
        def accumulated(p):
            if not self._in_step:
                return
            with self._lock:
                b.accumulated += 1
                if b.accumulated >= b.expected and not b.in_forward and b.state != HOST:
                    b.accumulated = 0
                    self._release(b)
        return accumulated

    def __repr__(self) -> str:
        return (f"WeightOffload(blocks={len(self._blocks)}, device={self.device}, "
                f"bytes={sum(self.block_bytes)})")


def _bytes(storage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage`` (what the copy engines move)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,))


class _Saved(tuple):
    """(block or None, what the hooks underneath packed)."""

    __slots__ = ()




def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _grad_outputs(output) -> list:
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad and output.grad_fn is not None else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in _grad_outputs(o)]
    return []


__all__ = ["WeightOffload", "WeightStepStats"]

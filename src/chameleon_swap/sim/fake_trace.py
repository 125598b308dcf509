"""Trace one training step of any ``nn.Module``: what it saves for backward, byte for byte.

The step runs for real through PyTorch's dispatcher, by default under ``FakeTensorMode``: every
tensor has its true shape, dtype and storage but no data, so a 70B model at 32k tokens traces on a
laptop CPU. Three things are recorded:

* every tensor autograd saves, through ``saved_tensors_hooks`` (the hooks the engine uses), with
  the engine's own rules: one entry per storage (storage object identity, so views and the tensor
  they view count once), parameters, buffers and views of them skipped;
* every operator with its FLOPs (``torch.utils.flop_counter``'s formulas; the CPU FlashAttention
  kernel's by hand) and the bytes it reads and writes, grouped into *segments*: a new forward
  segment whenever the innermost running module changes, a new backward segment whenever
  backward unpacks a tensor saved by another module than the last one;
* every storage the step allocates and when it dies (a finalizer on the storage object), which
  gives the step's peak memory above what existed before it, as ``max_memory_allocated`` counts
  it on a device, and the transient part of it that is neither saved activations nor gradients.

Without fake mode the same recorder runs a real step (tests compare it with the engine's counts).
"""
from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .traced import Recording, SavedTensor

LOW_PRECISION = (torch.bfloat16, torch.float16)
_CPU_FLASH = "_scaled_dot_product_flash_attention_for_cpu"
# The ops whose outputs selective checkpointing keeps: the same names as recompute/selective.py's
# (sim/ may not import recompute/; a test checks the two agree). Matmuls and attention are kept,
# norms, activations and elementwise ops are recomputed.
SELECTIVE_KEEPS = frozenset((
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "dot", "_scaled_mm", "_int_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
    "_efficient_attention_forward"))


class _Recorder(TorchDispatchMode):
    """Ops, saves, unpacks and storage lifetimes of one step."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.backward = False
        self.segments: list[list] = []
        self.seg_module: list[str] = []
        self.n_forward = 0
        self.bwd_key: Optional[str] = None
        self.saved: dict = {}                    # id(storage record) -> SavedTensor
        self.by_storage = weakref.WeakKeyDictionary()   # storage -> SavedTensor
        self.state = weakref.WeakKeyDictionary()        # parameter and buffer storages
        for t in list(model.parameters()) + list(model.buffers()):
            self.state[t.untyped_storage()] = True
        self.skipped = 0
        self.inputs = weakref.WeakKeyDictionary()       # storage -> modules it entered first
        self.saved_ids: set = set()
        # Storage lifetimes: (event index, +bytes or -bytes, storage id).
        self.known = weakref.WeakKeyDictionary()
        self.events: list[tuple] = []
        self.next_id = 0

    # --------------------------------------------------------------- segments
    def _slot(self) -> int:
        key = self.stack[-1] if self.stack else ""
        if self.backward:
            key = self.bwd_key if self.bwd_key is not None else ""
        if not self.segments or self.seg_module[-1] != key or \
                (self.backward and len(self.segments) == self.n_forward):
            self.segments.append([])
            self.seg_module.append(key)
        return len(self.segments) - 1

    def start_backward(self) -> None:
        self.backward = True
        self.n_forward = len(self.segments)

    # --------------------------------------------------------------- ops
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat_in = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                   if isinstance(a, torch.Tensor)]
        flat_out = [a for a in torch.utils._pytree.tree_leaves(out) if isinstance(a, torch.Tensor)]
        for t in flat_out:
            self._track(t)
        if func.is_view or not flat_out:
            return out
        nbytes = sum(t.numel() * t.element_size() for t in flat_in + flat_out)
        low = any(t.dtype in LOW_PRECISION for t in flat_in)
        # The bytes selective checkpointing would keep of this op (recompute/selective.py keeps
        # the outputs of matmuls and attention, and recomputes everything else).
        kept = sum(t.numel() * t.element_size() for t in flat_out) if (
            func._overloadpacket.__name__ in SELECTIVE_KEEPS and not self.backward) else 0
        self.segments[self._slot()].append((_flops(func, args, kwargs, out), nbytes, low, kept))
        return out

    def _track(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        if s in self.known or s in self.state:
            return
        sid = self.next_id
        self.next_id += 1
        self.known[s] = sid
        n = s.nbytes()
        self.events.append((n, sid))
        weakref.finalize(s, self.events.append, (-n, sid))

    # --------------------------------------------------------------- saved tensors
    def pack(self, t: torch.Tensor):
        if self.backward:
            return t, None, None                 # double backward: not part of one step
        s = t.untyped_storage()
        module = self.stack[-1] if self.stack else ""
        base = t if t._base is None else t._base
        if isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad) or \
                s in self.state:
            self.skipped += s.nbytes()
            return t, None, module
        rec = self.by_storage.get(s)
        if rec is None:
            self._track(t)
            self.saved_ids.add(self.known[s])
            rec = SavedTensor(s.nbytes(), str(t.dtype).replace("torch.", ""), tuple(t.shape),
                              module, len(self.saved), self._slot(), -1, tuple(self.inputs.get(s, ())))
            self.by_storage[s] = rec
            self.saved[rec.order] = rec
        return t, rec, module

    def unpack(self, packed):
        t, rec, module = packed
        # Backward slots follow the module that saved this use of the tensor (a storage saved by
        # every layer, like rotary tables, belongs to each layer's backward in turn).
        if self.backward and module is not None:
            if module != self.bwd_key:
                self.bwd_key = module
                if len(self.segments) > self.n_forward and not self.segments[-1]:
                    self.seg_module[-1] = module      # nothing ran under the last key
                else:
                    self.segments.append([])
                    self.seg_module.append(module)
            if rec is not None and rec.first_used_at < 0:
                rec.first_used_at = self._slot()
        return t

    def peaks(self, saved_ids: set, grad_ids: set) -> tuple[int, int]:
        live = other = peak = transient = 0
        for n, sid in self.events:
            live += n
            if sid not in saved_ids and sid not in grad_ids:
                other += n
            peak, transient = max(peak, live), max(transient, other)
        return peak, transient


def _flops(func, args, kwargs, out) -> int:
    packet = func._overloadpacket
    f = flop_registry.get(packet)
    if f is not None:
        return int(f(*args, **kwargs, out_val=out))
    name = packet.__name__
    if name.startswith(_CPU_FLASH):
        # Same count as the CUDA kernels' entries above: 4*b*h*s_q*s_k*d forward (QK^T and PV),
        # 2.5x that backward (Dao 2023, FlashAttention-2, Sec. 4); causal masking skips half.
        backward = name.endswith("_backward")
        q, k = (args[1], args[2]) if backward else (args[0], args[1])
        causal = bool(args[7] if backward else (args[4] if len(args) > 4 else
                                                kwargs.get("is_causal", False)))
        b, h, sq, d = q.shape
        fl = 4 * b * h * sq * k.shape[-2] * d * (0.5 if causal else 1.0)
        return int(fl * (2.5 if backward else 1.0))
    return 0


def _module_hooks(model: nn.Module, rec: _Recorder) -> list:
    handles = []
    for name, m in model.named_modules():
        path = name

        def pre(_m, args, kwargs, path=path):
            rec.stack.append(path)
            first = next((a for a in list(args) + list(kwargs.values())
                          if isinstance(a, torch.Tensor)), None)
            if first is not None:
                rec.inputs.setdefault(first.untyped_storage(), []).append(path)

        def post(_m, _a, _o, path=path):
            # Pop back to this module (an exception inside a child may have skipped its pop).
            while rec.stack and rec.stack.pop() != path:
                pass

        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, always_call=True))
    return handles


def record_step(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], *,
                autocast: Optional[torch.dtype] = None) -> Recording:
    """Run ``loss_fn(model).backward()`` once and record it. Call it inside the fake mode the
    model was built in (``trace_module`` does), or in real mode on a real model. ``autocast``:
    the lower precision dtype of ``torch.autocast`` on the model's device type, or None."""
    if autocast is not None and autocast not in LOW_PRECISION:
        raise ValueError(f"autocast must be torch.bfloat16, torch.float16 or None; got {autocast!r}")
    params = list(dict.fromkeys(model.parameters()))
    for p in params:
        p.grad = None
    device = params[0].device.type if params else "cpu"
    rec = _Recorder(model)
    handles = _module_hooks(model, rec)
    amp = torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext()
    try:
        with rec, torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
            with amp:
                loss = loss_fn(model)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError("loss_fn must return a one-element tensor (the loss)")
            rec.start_backward()
            loss.backward()
            del loss
    finally:
        for h in handles:
            h.remove()
    grads = [p.grad for p in params if p.grad is not None]
    grad_ids = {rec.known.get(g.untyped_storage()) for g in grads}
    tensors = [rec.saved[i] for i in sorted(rec.saved)]
    # Collect finalizers of everything the step dropped before reading the lifetimes.
    gc.collect()
    peak, transient = rec.peaks(rec.saved_ids, grad_ids)
    n = len(rec.segments)
    for t in tensors:
        if t.first_used_at < 0:
            t.first_used_at = n
    return Recording(segment_ops=rec.segments, segment_module=rec.seg_module,
                     n_forward=rec.n_forward, tensors=tensors, skipped_bytes=rec.skipped,
                     param_bytes=sum(p.numel() * p.element_size() for p in params),
                     grad_bytes=sum(g.untyped_storage().nbytes() for g in grads),
                     peak_bytes=peak, transient_bytes=transient)


def trace_module(build: Callable[[], nn.Module], loss_fn: Callable[[nn.Module], torch.Tensor],
                 *, autocast: Optional[torch.dtype] = None, fake: bool = True) -> Recording:
    """Build a model with ``build()`` and record one training step of it (``record_step``), under
    ``FakeTensorMode`` unless ``fake`` is False. ``loss_fn`` makes its inputs itself, so they are
    fake too. ``extra`` names the model's list of identical blocks (``block_prefix``), how many
    (``layers``) and the parameter bytes of one (``block_param_bytes``), when it has one."""
    from ..workloads.hf import find_block_list
    mode = torch._subclasses.fake_tensor.FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        model = build()
        rec = record_step(model, loss_fn, autocast=autocast)
    try:
        blocks = find_block_list(model)
    except ValueError:
        return rec
    prefix = next(name for name, m in model.named_modules() if m is blocks)
    one = blocks[1] if len(blocks) > 1 else blocks[0]
    rec.extra.update(block_prefix=prefix, layers=len(blocks),
                     block_param_bytes=sum(p.numel() * p.element_size() for p in one.parameters()))
    return rec

"""Selective checkpointing: which ops' outputs a selectively checkpointed block keeps (matmuls and
attention), and checkpoint contexts that report each kept output, so its bytes can be held."""
from __future__ import annotations

import contextlib
import inspect

import torch
from torch.utils.checkpoint import (CheckpointPolicy, SelectiveCheckpointContext,
                                    create_selective_checkpoint_contexts)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

# Outputs selective checkpointing keeps: matmuls and attention (expensive to recompute, and what
# backward needs anyway); norms, activations and elementwise ops are recomputed. Matched by
# overload packet, so every overload counts; ops missing from this torch are skipped.
_SAVED_OP_NAMES = (
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "dot", "_scaled_mm", "_int_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
    "_efficient_attention_forward")
SAVED_OPS = frozenset(getattr(torch.ops.aten, n) for n in _SAVED_OP_NAMES
                      if hasattr(torch.ops.aten, n))

# Recent torch (2.13 does) hands the op's output to the policy function; older torch gets an
# observing dispatch mode on top of checkpoint's caching mode instead (same ops, same bytes).
_OP_OUTPUT = "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters


def saves_output(func) -> bool:
    """Whether selective checkpointing keeps this op's output (instead of recomputing it)."""
    return getattr(func, "overloadpacket", None) in SAVED_OPS


class _KeepObserver(TorchDispatchMode):
    """Older torch: sees the outputs of the ops selective checkpointing keeps (entered on top of
    its caching mode, so the op has run there by the time the output comes back)."""

    def __init__(self, on_output) -> None:
        super().__init__()
        self.on_output = on_output

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if saves_output(func):
            self.on_output(out)
        return out


def can_decline() -> bool:
    """Whether ``selective_contexts``' ``on_output`` can decline an output: where the policy sees
    the output before checkpoint decides on it."""
    return _OP_OUTPUT


def selective_contexts(on_output):
    """checkpoint's ``(forward, recompute)`` contexts for selective checkpointing that keeps the
    outputs of ``saves_output`` ops and recomputes the rest; ``on_output(out)`` is called in the
    forward with each such op's output (a tensor or a tuple of them). Where ``can_decline()``,
    it returns whether to keep it: an output it declines is recomputed in backward like the rest
    (the budget has no room for it). Else (an older torch: the output is seen after checkpoint
    kept it) its answer is not asked for, and every one is kept."""
    if _OP_OUTPUT:
        decided: list = []          # the forward's answers, in order, for a recompute that asks

        def policy(ctx, func, *args, **kwargs):
            if not saves_output(func):
                return CheckpointPolicy.PREFER_RECOMPUTE
            if ctx.is_recompute:    # (a torch whose recompute asks again gets the same answers)
                keep = decided.pop(0) if decided else True
            else:
                keep = on_output(ctx.op_output) is not False
                decided.append(keep)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)

    def by_op(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if saves_output(func) else CheckpointPolicy.PREFER_RECOMPUTE
    caching, cached = create_selective_checkpoint_contexts(by_op)

    @contextlib.contextmanager
    def forward_ctx():
        with caching, _KeepObserver(on_output):
            yield
    return forward_ctx(), cached


class MutationWatch(TorchDispatchMode):
    """Watches a block run kept for what makes selective checkpointing fail on it: an op that
    writes in place into the output of an op selective checkpointing would keep (a matmul's
    output made ``relu_``'s input). Selective checkpointing caches that output in forward and, at
    the recompute, raises ("Tensor cached during selective activation checkpoint has been
    mutated") in the middle of backward, where the step cannot be saved. ``unsafe`` is True
    once such a write is seen; ``outputs`` holds the storages of the kept ops' outputs, for
    the caller to check against the block's own output (a later block may write into it).

    Storages are known by weak references (``StorageWeakRef``): they hold no bytes, and while
    one is held its storage's address cannot be taken by a later one (a plain address was:
    freed intermediates' addresses came back, and a block was read unsafe one run in three)."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: dict = {}
        self.unsafe = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.outputs and not self.unsafe and func._schema.is_mutable:
            self.unsafe = any(_kept(self.outputs, t) for t in _written(func, args, kwargs))
        out = func(*args, **kwargs)
        if saves_output(func):
            for t in _tensors(out):
                ref = StorageWeakRef(t.untyped_storage())
                self.outputs[ref.cdata] = ref
        return out


def aliases(outputs: dict, value) -> bool:
    """Whether any tensor in ``value`` (a block's output) shares storage with ``outputs``."""
    return any(_kept(outputs, t) for t in _tensors(value))


def _kept(outputs: dict, t: torch.Tensor) -> bool:
    ref = outputs.get(t.untyped_storage()._cdata)
    return ref is not None and not ref.expired()


def _written(func, args: tuple, kwargs: dict):
    """The tensors ``func`` writes into (its arguments marked written in its schema)."""
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            yield from _tensors(args[i] if i < len(args) else kwargs.get(a.name))


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)

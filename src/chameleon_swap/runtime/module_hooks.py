"""The engine's global module hooks: what it learns from module calls during a step.

Before a module runs: its buffers are protected (buffers are neither parameters nor leaves that
require grad, and only the module that holds them knows them), the profiler sees a module event,
a ``device_memory_limit`` learns how far the forward has come (and may lower the budget), and
with ``model=`` the recompute runner's probe looks for the user's own checkpoint inside a block
(its own global hook would be a third on every module call).
After it runs: the profiler's module event ends and, when a budget can move things, a hook on the
gradient of the module's output tells the executor that backward is about to reach the tensors
this module saved (the moment to start copying them back).

The hooks are registered once for the engine's life and idle outside a step: re-registering them
every step would change the hook ids torch.compile guards on and recompile every compiled module
every step. They hold the engine weakly, so an engine never closed can still be collected.

Any global module hook sends every module call in the process through torch's slow call path
(about 1 us per call before the hook runs). An engine that never moves needs none of the above but
the buffer check, so it gets that one hook, registered at creation as the others are (compile
guards never see the hooks change); its profiles then know saves by order alone.

An idle engine's hooks still cost other code in the process that slow path and their own calls:
measured on this project's 2-core CPU, the CPU demo's gradient-checkpointed Llama stepped 1.9%
slower with one idle engine alive and 3.6% with two. ``paused`` takes them out for a while, for
side-by-side comparisons in one process (the demo's legs: each runs with no engine's hooks but
its own, as it would alone).
"""
from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from typing import Callable, Optional

import torch

from ._eager import eager, frame_callback, is_compiling, mark_eager

_mod = torch.nn.modules.module


def register(eng, resident_only: bool) -> list:
    """Register the engine's global module hooks; returns their handles."""
    if resident_only:
        return [_mod.register_module_forward_pre_hook(_weak_hook(eng, _buffers))]
    pre, post = _step_hooks(eng)
    return [_mod.register_module_forward_pre_hook(pre), _mod.register_module_forward_hook(post)]


def remove(hooks) -> None:
    for h in hooks:
        h.remove()


@contextlib.contextmanager
def paused(engines):
    """The global module hooks of ``engines`` (between their steps) taken out, and registered
    again on leaving. Registered again, they are new hooks to torch.compile's guards: a compiled
    module called meanwhile or after compiles again (the demo compiles nothing)."""
    engines = [e for e in engines if e._hooks]
    busy = [e for e in engines if e._in_step]
    if busy:
        raise RuntimeError("chameleon-swap: module_hooks.paused needs engines between steps; "
                           f"{len(busy)} of them is in a step")
    held = [(e, e._hooks) for e in engines]
    for e, hooks in held:
        remove(hooks)
    try:
        yield
    finally:
        for e, hooks in held:
            if e._hooks is hooks:           # (not closed meanwhile: close() empties it anew)
                hooks[:] = register(e, e._resident_only)   # in place: the finalizer holds it


class _StandIn(OrderedDict):
    """An empty stand-in for one of torch's global forward-hook dicts while a block runs quiet
    (``Quiet``). A hook registered meanwhile goes into it, and at the end into ``real`` too; its
    handle, made on the stand-in (torch keeps a weak reference to the dict it was made on),
    removes it from both, so the stand-in is kept alive while it holds one (``_KEPT``)."""

    def __init__(self, real: OrderedDict) -> None:
        super().__init__()
        self.real = real

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self.real.pop(key, None)


_KEPT: list = []        # stand-ins holding hooks registered inside quiet blocks, for their handles


class Quiet:
    """The engine's global module hooks out of the way while a block runs checkpointed, for the
    module calls inside it to take torch's fast call path (``Quiet(eng, forward)``: ``forward``
    for a checkpointed block's forward, else its recompute), and for the rest of a lean step
    (``Chameleon._go_lean``: until the step ends or trips; a block's own inside it finds the
    hooks gone already and does nothing).

    Inside a full block's forward (under no_grad) and its recompute the hooks do nothing but the
    runner's probe, which a walk of the recompute's graph replaces (``full.py``; it finds every
    leaf the probe finds, and those no module holds). Measured on this project's 2-core CPU (the
    demo's Llama at 160 tokens, every block recomputed, thread CPU time of 40 interleaved steps),
    the hooks out of the way took 1.0% off the step in the blocks' forwards and 3.3% in their
    recomputes too; with the walk of every recompute paid (81-133 us a block then; its cost now
    in ``full._foreign``), whole steps read 0.98-1.03x of the hooks left in over four runs of
    40-80 steps: level within this machine's noise, and every backward walked.

    They are taken out only where nothing can tell: they are the only global forward hooks (so
    putting them back restores the order), torch.compile has compiled no frame in this process
    (dynamo reads these dicts when it traces a module call), and, in a forward, no
    ``device_memory_limit`` counts module calls. Otherwise this does nothing."""
    __slots__ = ("eng", "forward", "held")

    def __init__(self, eng, forward: bool) -> None:
        self.eng, self.forward, self.held = eng, forward, None

    def __enter__(self) -> None:
        eng = self.eng
        pre, post = _mod._global_forward_pre_hooks, _mod._global_forward_hooks
        if eng is None or not eng._hooks or len(pre) + len(post) != len(eng._hooks) \
                or (self.forward and eng._memory is not None) or _compiled() \
                or not all(h.id in pre or h.id in post for h in eng._hooks):
            return
        # Empty stand-ins in their place, the dicts themselves left as they are: a module call
        # on another thread may be going through them (nn.DataParallel's replicas), and
        # rebinding a module attribute is atomic where emptying a dict under an iteration
        # would raise in that thread. torch reads them by that attribute at every call.
        self.held = (pre, post)
        _mod._global_forward_pre_hooks = _StandIn(pre)
        _mod._global_forward_hooks = _StandIn(post)

    def __exit__(self, *exc) -> None:
        held, self.held = self.held, None
        if held is None:
            return
        stand_ins = (_mod._global_forward_pre_hooks, _mod._global_forward_hooks)
        _mod._global_forward_pre_hooks, _mod._global_forward_hooks = held
        # A hook registered meanwhile went into a stand-in: it runs from here on too, and its
        # handle removes it through the stand-in, kept while it holds any.
        _KEPT[:] = [d for d in _KEPT if d]
        for real, stand_in in zip(held, stand_ins):
            if stand_in:
                real.update(stand_in)
                _KEPT.append(stand_in)


try:
    from torch._dynamo.utils import counters as _dynamo_counters
except ImportError:                      # no dynamo: nothing compiles
    _dynamo_counters = None


def _compiled() -> bool:
    """Whether torch.compile has converted a frame in this process (True where that cannot be
    told)."""
    if _dynamo_counters is None:
        return False
    try:
        return _dynamo_counters["frames"]["total"] > 0
    except Exception:                    # (a torch whose counters differ: assume it has)
        return True


def _weak_hook(eng, fn: Callable):
    # A weak reference to the engine and a plain function: cheaper per call than a WeakMethod,
    # which builds a new bound method every time (these run on every module call).
    ref = weakref.ref(eng)

    def hook(*args):
        obj = ref()
        if obj is not None:
            return fn(obj, *args)
    return eager(hook)


def _buffers(eng, module: torch.nn.Module, args) -> None:
    if eng._in_step and module._buffers and not is_compiling():
        eng._ex.protect_buffers(module)


def _step_hooks(eng):
    """The pre and post hooks of an engine that moves, each one Python frame for the calls that
    need nothing (outside a step, inside a block's checkpointed forward or its recompute).

    Measured on this project's 2-core CPU (the demo's Llama at 160 tokens, every block recomputed,
    thread CPU time over 30 interleaved steps): torch's slow call path alone, with two no-op global
    hooks, cost the plain step 1.8%; the engine's hooks, at four to five frames a call (``eager``'s
    wrapper, the weak reference's, the hook, the probe and the checks as calls), cost the engine's
    step 4.5% of checkpointing's. Here the frame callback test (``mark_eager``), the weak
    reference and the early returns are inline, and the runner's probe is called only while a
    block call is running (``BlockRunner.probe``'s own first test)."""
    ref = weakref.ref(eng)

    def pre(module, args):
        if frame_callback() is not None:
            return disabled_pre(module, args)
        e = ref()
        if e is None or not e._in_step:
            return
        if e._lean_step:                # the lean path (engine._go_lean): buffers only
            _buffers(e, module, args)
            return
        runner = e._runner
        if runner is not None:
            if runner._probe is not None:
                runner.probe(module)    # the runner's probe rides on this hook (``install``)
            # Inside a block's checkpointed forward (full or selective) the saves go to
            # checkpoint, not through the engine: its modules' calls carry no event the
            # profiler, the policy or the backward triggers need (about 100 of the demo's 200
            # module calls a step). A ``device_memory_limit`` reads progress by module count, so
            # it still sees them all. A block's forward run again in backward is not a new
            # module call of the step.
            if runner._recomputes or (runner.quiet and e._memory is None):
                return
        _pre(e, module)

    def post(module, args, output):
        if frame_callback() is not None:
            return disabled_post(module, args, output)
        e = ref()
        if e is None or not e._in_step or e._lean_step:
            return
        runner = e._runner
        if runner is not None and (runner._recomputes or (runner.quiet and e._memory is None)):
            return
        _post(e, module, output)

    pre, disabled_pre = mark_eager(pre)
    post, disabled_post = mark_eager(post)
    return pre, post


def _pre(eng, module: torch.nn.Module) -> None:
    if is_compiling():
        return
    ex = eng._ex
    ex.protect_buffers(module)
    eng._module_starts.append(ex.next_index)
    if eng._memory is not None:
        # (the step's size so far: what recomputed blocks did not save counts, as at its end)
        lowered = eng._memory.on_progress(ex.stats.saved_bytes + eng._unsaved_bytes())
        if lowered is not None:
            ex.budget = lowered       # the step is larger than assumed: hold more off the device
    eng._profiler.module_enter(module)


def _post(eng, module: torch.nn.Module, output) -> None:
    if is_compiling():
        return
    eng._profiler.module_exit(module)
    ex = eng._ex
    start = eng._module_starts.pop() if eng._module_starts else 0
    # With no budget nothing comes back in backward, so no trigger is needed: a tensor hook
    # costs about as much as a pack, registered here and called again in backward.
    if ex.budget is None or ex.next_index == start or not torch.is_grad_enabled():
        return
    t = first_grad_output(output)
    if t is not None:
        # Fires when the gradient of this module's output is ready: just before backward
        # reaches the tensors this module saved.
        t.register_hook(ex.backward_trigger)


def first_grad_output(output) -> Optional[torch.Tensor]:
    """The first tensor with a ``grad_fn`` in a module's output (tensors, lists, tuples, dicts)."""
    if isinstance(output, torch.Tensor):
        return output if output.grad_fn is not None else None
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        for o in output:
            t = first_grad_output(o)
            if t is not None:
                return t
    return None

"""Keep torch.compile out of the engine's hooks, at (almost) no cost in eager code.

The engine's hooks must run eagerly: dynamo must neither inline them into a traced graph (it would
hold the engine's objects in its tracing state and guard on them) nor compile their frames when a
compiled function calls them at run time (a graph break runs eager operators inside the compiled
frame, with dynamo's frame callback active, and their saved tensors reach our pack hook).
``torch.compiler.disable`` does both, but its wrapper resets the frame callback on every call:
about 0.3 us per hook call, paid in plain eager code where no callback is set at all.

``eager(fn)`` returns a function that calls ``fn`` directly when no frame callback is set (eager
code: one C call to find out) and goes through ``torch.compiler.disable(fn)`` otherwise. For
dynamo's tracer it is marked as a disabled function (not inlined: a graph break, then an eager
call), and its own code object is skipped by the frame callback, so only ``fn`` runs under the
disable wrapper. Without these private entry points (an older torch), it is the plain disable.
"""
from __future__ import annotations

import torch

try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _callback
    from torch._dynamo.eval_frame import skip_code as _skip_code
except ImportError:                      # an older torch: the plain disable wrapper
    _callback = _skip_code = None

_disable = getattr(getattr(torch, "compiler", None), "disable", None)


def _mark(fn, code) -> None:
    """Tell dynamo not to inline ``fn`` (a graph break, then an eager call) and not to compile
    frames of ``code``."""
    fn._torchdynamo_disable = True
    fn._torchdynamo_disable_msg = "chameleon-swap's hooks run eagerly"
    _skip_code(code)


def eager(fn):
    """``fn``, kept out of torch.compile (see the module docstring)."""
    if _disable is None or getattr(fn, "_chameleon_eager", False):
        return fn
    disabled = _disable(fn)
    if _callback is None:
        return disabled

    def run(*args):
        if _callback() is None:          # eager code: no frame callback to keep away
            return fn(*args)
        return disabled(*args)

    _mark(run, run.__code__)
    return run


def mark_eager(fn):
    """For a hook that makes ``eager``'s test itself (one Python frame less per call): it starts
    with ``if frame_callback() is not None: return <its disabled self>(...)``. Returns ``(hook,
    disabled)``: ``fn`` marked for dynamo as ``eager`` marks its wrapper, and
    ``torch.compiler.disable(fn)``; without the private entry points, both are the latter."""
    if _disable is None:
        return fn, fn
    disabled = _disable(fn)
    if _callback is None:
        return disabled, disabled
    _mark(fn, fn.__code__)
    fn._chameleon_eager = True           # eager(fn) is fn
    return fn, disabled


# None in eager code (no frame callback set); see ``mark_eager``.
frame_callback = _callback if _callback is not None else (lambda: None)

# True while torch.compile traces: the engine's module hooks step aside then (no graph breaks);
# a compiled region's saved tensors still go through the pack/unpack hooks, which run eagerly.
is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)

# The saved-tensor hooks in force on this thread (``top_saved_hooks(False)``: (pack, unpack) or
# None); None on a torch without the entry point.
top_saved_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)

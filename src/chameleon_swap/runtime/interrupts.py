"""A Ctrl-C that lands inside the release of a saved tensor (a ``__del__``) is not lost.

Python raises ``KeyboardInterrupt`` between any two bytecodes, the first one of a ``__del__``
included, before any ``try`` inside it can catch anything. Whatever escapes a ``__del__`` goes to
``sys.unraisablehook`` ("Exception ignored in ...") and is otherwise dropped: the user's Ctrl-C
would be lost and the release left undone. ``Handle.__del__`` catches the interrupt itself once
its ``try`` has begun (``caught``); for what escapes (its first instruction, or any instruction of the lean
path's ``_Saved.__del__``) this module chains a hook in front of ``sys.unraisablehook``. The hook
recognises the engine's finalizers (``@finalizer``), keeps the interrupt pending for the engine to
raise again at the step boundary (``take_pending``), and asks every live executor to recount its
books at its next ``settle()``. Anything else goes on to the hook that was there before.

The hook is (re)installed whenever an executor is made, on top of whatever hook is current then,
so a hook set by a test runner or a user before that keeps working behind it.
"""
from __future__ import annotations

import sys
import weakref

_FINALIZERS: set = set()             # code objects of the engine's __del__ methods
_executors: "weakref.WeakSet" = weakref.WeakSet()
_pending = False                     # an interrupt escaped one of them and was not raised yet


def finalizer(fn):
    """Mark ``fn`` (a ``__del__``) as one of the engine's releases."""
    _FINALIZERS.add(fn.__code__)
    return fn


def watch(ex) -> None:
    """Recount ``ex``'s books after an interrupt escapes a release; make sure the hook is on."""
    _executors.add(ex)
    install()


def install() -> None:
    prev = sys.unraisablehook
    if getattr(prev, "_chameleon_swap", False):
        return

    def unraisable(u, _prev=prev):
        if _is_ours(u):
            _escaped()
            return
        _prev(u)

    unraisable._chameleon_swap = True
    sys.unraisablehook = unraisable


def _is_ours(u) -> bool:
    if u.exc_type is None or not issubclass(u.exc_type, KeyboardInterrupt):
        return False
    fn = getattr(u.object, "__func__", u.object)      # the __del__, bound or not
    return getattr(fn, "__code__", None) in _FINALIZERS


def caught() -> None:
    """A release caught an interrupt itself (its books are repaired by ``settle()``): keep it
    pending for the engine to raise, as one that escaped."""
    global _pending
    _pending = True


def _escaped() -> None:
    caught()
    for ex in list(_executors):
        ex.recount = True


def take_pending() -> bool:
    """Whether an interrupt escaped a release since the last call (and forget it)."""
    global _pending
    was, _pending = _pending, False
    return was

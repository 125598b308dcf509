"""Policies decide what moves and when; the executor carries it out.

Every policy implements ``begin_step``, ``make_room(rec)`` (forward: room for a new record),
``after_save(rec)``, ``on_unpack(rec)``, ``on_backward_trigger()``, ``make_room_backward(rec)``
and ``end_step``. The guard is the default and the safety net under the others.
"""
from __future__ import annotations

from .guard import GuardPolicy

POLICIES = {"guard": GuardPolicy}


def make_policy(name: str, executor):
    return POLICIES[name](executor)

"""Policies decide what moves and when; the executor carries it out.

Every policy implements ``begin_step``, ``make_room(rec)`` (forward: room for a new record),
``after_save(rec)``, ``on_first_use(rec)``, ``on_unpack(rec)``, ``on_backward_trigger()``,
``make_room_backward(rec)``, ``wants_detail()``, ``end_step(profile)`` and ``report()``.
The guard is the safety net under the others.

Owns the per-step decisions: which record moves, when it comes back, and whether a block is kept,
swapped or recomputed (``guard.py``, ``chameleon.py``, ``static.py``, ``schedule.py``,
``block_modes.py``, blocks recomputed when the host arena is short in ``host_room.py``, the
memory cap in ``memory.py``), and the closed loop that checks every plan
against the step it ran and corrects the model when it misses (``checks.py``).

May import: ``config``, ``runtime/`` (the executor it drives, the profile it reads), ``planning/``
(the searches it asks) and ``copy/``. Never ``engine.py``.
Imported by: ``engine.py`` and ``parallel/``.
"""
from __future__ import annotations

from .guard import GuardPolicy
from .chameleon import ChameleonPolicy
from .static import StaticPolicy
from .schedule import ScheduleGuardPolicy

POLICIES = {"guard": GuardPolicy, "chameleon": ChameleonPolicy, "static": StaticPolicy,
            "schedule": ScheduleGuardPolicy}


def make_policy(name: str, executor, **kwargs):
    cls = POLICIES[name]
    return cls(executor, **kwargs) if not issubclass(cls, GuardPolicy) else cls(executor)

"""Policies decide what moves and when; the executor carries it out.

Every policy implements ``begin_step``, ``make_room(rec)`` (forward: room for a new record),
``after_save(rec)``, ``on_first_use(rec)``, ``on_unpack(rec)``, ``on_backward_trigger()``,
``make_room_backward(rec)``, ``wants_detail()``, ``end_step(profile)`` and ``report()``.
The guard is the safety net under the others.
"""
from __future__ import annotations

from .guard import GuardPolicy
from .planned import ChameleonPolicy, StaticPolicy
from .schedule import ScheduleGuardPolicy

POLICIES = {"guard": GuardPolicy, "chameleon": ChameleonPolicy, "static": StaticPolicy,
            "schedule": ScheduleGuardPolicy}


def make_policy(name: str, executor, **kwargs):
    cls = POLICIES[name]
    return cls(executor, **kwargs) if not issubclass(cls, GuardPolicy) else cls(executor)

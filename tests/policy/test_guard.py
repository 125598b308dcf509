"""The guard (policy/guard.py): what it does when a copy back needs room in backward."""
from __future__ import annotations

from types import SimpleNamespace

from chameleon_swap.policy.guard import GuardPolicy
from chameleon_swap.runtime.executor import OFFLOADING, RESIDENT, Record
from chameleon_swap.runtime.records import _Need


def _rec(index: int, state: str) -> Record:
    r = Record(index, 40, False, None, None)
    r.state, r.counted = state, True
    r.out_ticket = object() if state == OFFLOADING else None
    return r


def test_room_in_backward_skips_copies_an_earlier_wait_completed_or_released():
    # Waiting for one copy-out handles the completions it lets through, which can release other
    # records (their tensors died): their ticket is gone. The guard waited on such a record
    # and the CPU copy engine raised AttributeError on a None ticket (seen once in a real-clock
    # test, a recompute's hold in backward). It skips them, and skips a record that an earlier
    # wait released or whose copy-out was put off (``offload`` returned False).
    first, second, third = _rec(0, OFFLOADING), _rec(1, OFFLOADING), _rec(2, RESIDENT)
    waited, offloaded = [], []

    def wait_offload(r):
        waited.append(r.index)
        if r is first:                     # its wait let the others' completions through
            second.state, second.out_ticket = "released", None
    ex = SimpleNamespace(resident_bytes=120, budget=100, live={first, second, third},
                         _earlier=set(), wait_offload=wait_offload,
                         offload=lambda r: offloaded.append(r.index) or False)
    guard = GuardPolicy.__new__(GuardPolicy)
    guard.ex = ex
    need = _Need(30)
    assert guard.make_room_backward(need) is False
    assert waited == [0]                   # not the released one, nor the put-off one
    assert offloaded == [2]

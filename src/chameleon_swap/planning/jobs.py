"""What a policy asks of the planner as one call, made in-process or in a worker process.

``plan_swaps`` (``swaps.plan``) makes one operator sequence's swap plan (``policy/swap_jobs.py``);
``plan_size`` makes one step size's mode plan (``policy/block_modes.py``): the quiet mix where
the figures are not trusted yet (``quiet.py``), else (or where no quiet mix fits) the full mode
search (``modes.plan_hybrid``). A policy calls it directly, or has ``serve`` run it in a worker
(``policy/background.py``), so that a step never waits for its planner: on the project's CPU
demo a plan took 40-145 ms against steps of 50-300 ms, and the engine's leg spent 12-14% of its
time planning on the step's own thread.

``serve`` is the worker's loop: jobs and results are pickled on its standard input and output.
Only this package and the standard library are imported, as everywhere in ``planning/``: the
worker starts without torch (in about 50 ms) and holds no device.
"""
from __future__ import annotations

import pickle
import time
import traceback
from typing import BinaryIO, Collection, Mapping, Optional, Sequence

from .modes import Block, HybridPlan, plan_hybrid
from .quiet import plan_quiet
from .swaps import plan as plan_swaps
from .timeline import Profile


def plan_size(profile: Profile, blocks: Sequence[Block], budget: int, host_limit: Optional[int],
              incumbent: Optional[tuple], measured: Mapping[tuple, float],
              quiet: bool, held: Optional[Collection[tuple]] = None) -> HybridPlan:
    """One size's mode plan (``quiet``: the figures are not trusted yet: the fastest mix that
    moves nothing, where one fits; ``held``: ``plan_hybrid``'s)."""
    return (plan_quiet(profile, blocks, budget) if quiet else None) or plan_hybrid(
        profile, blocks, budget, host_limit=host_limit, incumbent=incumbent, measured=measured,
        held=held)


JOBS = {"plan_size": plan_size, "plan_swaps": plan_swaps}


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """Answer jobs ``(ticket, name, args)`` read from ``inp`` with ``(ticket, seconds, ok,
    result)`` written to ``out`` (``seconds``: the job's CPU time; ``result``: the return value,
    or the error's traceback as text where ``ok`` is False), until ``inp`` ends."""
    while True:
        try:
            ticket, name, args = pickle.load(inp)
        except EOFError:
            return
        t0 = time.process_time()        # (its CPU time: a starved process's waits are not its)
        try:
            ok, result = True, JOBS[name](*args)
        except Exception:       # (reported, and the policy plans in-process instead)
            ok, result = False, traceback.format_exc()
        pickle.dump((ticket, time.process_time() - t0, ok, result), out,
                    protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()

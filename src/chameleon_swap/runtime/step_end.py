"""The end of one step: the books closed, the profile handed to the policy, ``StepStats`` built.

``finish_step`` runs in the engine's ``step()`` ``finally``, whether the step ended normally or
by an exception. Interrupted anywhere in here, the next step's start (or ``close()``) finishes the
job (``Executor.settle``).

A step's time (``StepTimer``): a step that ends with a synchronization (the CPU, a budget, a timed
step) measures its wall time, device included. On CUDA a step with no budget does not wait for the
device, so its wall time would be the host's only: instead CUDA events are recorded at its start and
end, and its ``step_seconds`` are filled in from them at a later step's end (or ``close()``), once
the end event has completed (``Event.query``: no synchronization). Until then, and for good if it
never completes in time, ``step_seconds`` is None; ``host_seconds`` is always the host's time.

The policy's planning at a step's end (``_young_gc_paused``) runs with Python's cyclic garbage
collector paused. Planning builds tens of thousands of short-lived containers (simulated
timelines, candidate plans and their caches) that reference counting frees when it returns. A
young collection while they are alive moves them to the oldest generation, and CPython 3.11 runs a
full collection once a quarter as many objects as that generation holds have moved there since
the last one: a process with transformers loaded holds about 400,000 objects, and a full
collection of them took 150-180 ms on this project's 2-core CPU, a step of the demo's model three
times over. Measured on the demo's model: the engine's first three steps (its first plans) moved
23,000 objects to the oldest generation, 4,600 with collection paused; one of those full
collections landed in the engine's third step of a 36-step run. The collector's state is put back
as it was (a user who disabled it keeps it disabled). Its time is ``StepStats.planning_seconds``,
apart from the step's own (``host_seconds``, ``step_seconds``: what the planner's model is of).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
import warnings
from collections import deque
from typing import Callable, Optional

import torch

from ..config import format_bytes
from .stats import StepStats, block_stats
from ..planning.signatures import similarity
from .trace import write_step

log = logging.getLogger("chameleon_swap")


def finish_step(eng, t0: float, budget: Optional[int], failed: bool,
                oom: bool = False) -> None:
    try:
        counters = eng._ex.end_step(failed)
        eng._pool.end_step()
        memory = {}
        if needs_sync(eng, budget):
            sync_device(eng.device)
        host_seconds = time.perf_counter() - t0
        # Synchronized, the wall time is the step's own; else it comes from events, a step late.
        step_seconds = None if eng._timer.lagging else host_seconds
        stalls = eng._copy.take_stalls()
        # (the recomputes' times are without the waits inside them: given before they are read)
        calls = (eng._runner.end_step(failed, [s for _, s in stalls])
                 if eng._runner is not None else [])
        if eng.device.type == "cuda" and eng._memory is not None:
            memory = _end_memory_step(eng, counters, failed, oom, calls)
        if eng._lean_step:
            _lean_profile(eng._profiler, eng._lean_from)
        profile = eng._profiler.finish(host_seconds, stalls)
        profile.blocks = calls
        profile.extra["link"] = eng._copy.take_link()
        # (what the copy threads' own CPU added to the step's moves: ``move_seconds_each``)
        profile.extra["copy_cpu"] = eng._copy.take_cpu()
        # (time the host arena spent allocating during the step: ``policy.checks.pinned``)
        profile.extra["host_alloc_seconds"] = eng._pool.allocating_seconds(t0, time.perf_counter())
        # (time the planner process had jobs beside it, where it had no core of its own)
        profile.extra["planner_seconds"] = planner_busy_seconds(eng, t0)   # (checks.contended)
        # A lean step's profile holds only the saves before its lean path: not its sequence.
        lean = ("tripped" if eng._policy.modes.tripped else "whole") if eng._lean_step else ""
        changed = _changed(eng, profile.ids, lean)
        t_plan = time.perf_counter()
        with _young_gc_paused():
            eng._policy.end_step(None if failed else profile)
        planning_seconds = time.perf_counter() - t_plan
        report = eng._policy.report()
        stats = StepStats(
            step=eng.totals.steps, budget_bytes=budget,
            peak_resident_bytes=counters.peak_resident_bytes, saved_bytes=counters.saved_bytes,
            offloaded_bytes=counters.offloaded_bytes,
            offloaded_tensors=counters.offloaded_tensors,
            prefetched_bytes=counters.prefetched_bytes, fetched_bytes=counters.fetched_bytes,
            sync_fetches=counters.sync_fetches, late_prefetches=counters.late_prefetches,
            budget_waits=counters.budget_waits, stall_seconds=float(sum(s for _, s in stalls)),
            step_seconds=step_seconds, host_seconds=host_seconds, host_peak_bytes=eng._pool.peak_in_use_bytes,
            skipped_bytes=counters.skipped_bytes, failed=failed, **memory,
            sequence_changed=changed, plan_source=report["plan_source"],
            predicted_stall_seconds=report["predicted_stall_seconds"],
            predicted_step_seconds=report.get("predicted_step_seconds"),
            profiler_seconds=profile.profiler_seconds, planning_seconds=planning_seconds,
            background_planning_seconds=report.get("background_planning_seconds", 0.0),
            profile_mode="detailed" if profile.detailed else "lightweight",
            signature=profile.signature, plan_overrides=report["plan_overrides"],
            forced_offloads=counters.forced_offloads, kept_bytes=counters.kept_bytes,
            host_allocated_bytes=eng._pool.allocated_bytes - eng._host_allocated_at_start,
            host_wait_seconds=eng._pool.wait_seconds - eng._host_wait_at_start,
            host_deferred_moves=counters.host_deferred_moves,
            lean=lean, **block_stats(calls, eng._runner is not None,
                                     eng._runner.lean_calls if lean and eng._runner else 0))
        eng.history.append(stats)
        eng.totals.add(stats)
        eng._timer.end(stats, eng.totals)
        log.info("%s", stats)
        if eng._trace_dir is not None and not failed:
            _write_trace(eng, profile, stats)
        _warn_foreign(eng, counters)
    finally:
        eng._in_step = False


def planner_busy_seconds(eng, since: float) -> float:
    """How long the engine's planner process (``policy/background.py``) had jobs to work on
    since ``since`` (the step's start) on a machine with no core to spare for it: the step's
    own threads (on the CPU its compute threads and a copy worker, on a GPU the thread that
    launches its kernels) and the planner's would need more cores than the process may run on;
    0.0 where they would not, or where there is no planner process. Over a tenth of the step,
    the step's time is partly the planner's (``policy.checks.contended``: it is not learnt from).
    Measured on this project's 2-core CPU (the emulated-link benchmark's HF Llama 256x8 at 25%,
    three short runs each way): with the planner process, 256 tokens' second visit, while the
    first plans were being made, ran 0.66-0.71 s in two runs (in the third the swap-only
    engine's did, 0.67 s) where later steps ran 0.30-0.42 s; with plans made on the step's
    thread, 0.33-0.44 s in all three."""
    worker = getattr(getattr(eng._policy, "modes", None), "worker", None)
    if worker is None or worker.broken is not None:
        return 0.0
    step_threads = torch.get_num_threads() + 1 if eng.device.type == "cpu" else 1
    return worker.busy_seconds(since) if step_threads + 1 > _cores() else 0.0


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):           # (not on Linux)
        return os.cpu_count() or 1


def _lean_profile(prof, n: int) -> None:
    """A lean step's profile (``policy/lean.py``): its ``n`` saves before its lean path began,
    untimed. The saves after were not seen, and records saved after a trip are numbered past
    them; the policy plans nothing from such a step."""
    prof.ids, prof.keys, prof.nbytes = prof.ids[:n], prof.keys[:n], prof.nbytes[:n]
    prof.used = [i for i in prof.used if i < n]
    prof.detailed = False


@contextlib.contextmanager
def _young_gc_paused():
    """Python's cyclic garbage collector paused while the block runs (see the module docstring);
    left as it is where it was already disabled."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _changed(eng, ids: list, lean: str) -> bool:
    """``StepStats.sequence_changed``. A lean step records no sequence (its profile stops where
    its lean path starts): it, and the step after it, compare the steps' sizes instead (the
    lean sizes' keys: a new size is a new sequence; the same size, read as the same). Before,
    a lean step read as unchanged, and the demo's Llama, whose length changes at most steps,
    counted 15 changes in its 40 steps, where the executor's path had counted 26; now 26. An
    MoE's routing changes its sequence within a size, which a lean step cannot see: the demo's
    MoE counts 31 where the executor's path counted 39."""
    size = eng._policy.modes.lean_sizes.key if eng._lean_ok else None
    prev, eng._prev_size = eng._prev_size, (size, bool(lean))
    if lean or (prev is not None and prev[1]):
        if not lean and ids:
            eng._prev_ids = ids
        return prev is not None and size is not None and prev[0] != size
    return _sequence_changed(eng, ids)


def _sequence_changed(eng, ids: list) -> bool:
    """Whether this step's operator sequence differs from the last one's beyond the tolerance;
    a step that saved nothing (eval under no_grad) changes nothing."""
    if not ids:
        return False
    changed = False
    # The same sequence again (the common case) needs no histogram comparison.
    if eng._prev_ids is not None and eng._prev_ids != ids:
        changed = similarity(eng._prev_ids, ids).changed(
            eng.config.length_tolerance, eng.config.min_similarity)
    eng._prev_ids = ids
    return changed


class StepTimer:
    """Device-inclusive step times without synchronizing (see the module docstring).

    ``begin(timed)`` at the step's start records a start event when ``timed`` (a CUDA step whose
    end will not synchronize) and returns the host clock; ``end(stats, totals)`` records the end
    event and fills in ``step_seconds`` of every earlier step whose end event has completed,
    oldest first, adding them to ``totals``. At most ``MAX_PENDING`` steps wait for their events;
    older ones keep ``step_seconds=None``."""

    MAX_PENDING = 64

    def __init__(self, device: torch.device, new_event: Optional[Callable] = None,
                 stream: Optional[Callable] = None) -> None:
        self._new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._stream = stream or (lambda: torch.cuda.current_stream(device))
        self._start = None
        self._pending: deque = deque()      # (StepStats, start event, end event), oldest first

    @property
    def lagging(self) -> bool:
        """The step under way is timed by events (its ``step_seconds`` come later)."""
        return self._start is not None

    def begin(self, timed: bool) -> float:
        self._start = None
        if timed:
            start = self._new_event()
            start.record(self._stream())
            self._start = start
        return time.perf_counter()

    def end(self, stats, totals) -> None:
        start, self._start = self._start, None
        if start is not None:
            end = self._new_event()
            end.record(self._stream())
            self._pending.append((stats, start, end))
            if len(self._pending) > self.MAX_PENDING:
                self._pending.popleft()     # never read: its step_seconds stay None
        self.resolve(totals)

    def resolve(self, totals) -> None:
        """Fill in the steps whose end event has completed (in stream order: stop at the first
        that has not)."""
        while self._pending:
            stats, start, end = self._pending[0]
            if not end.query():
                return
            self._pending.popleft()
            stats.step_seconds = start.elapsed_time(end) / 1e3     # ms -> s
            totals.step_seconds += stats.step_seconds


def begin_timing(eng, budget: Optional[int]) -> float:
    """The step's start on the host clock; on CUDA, a step that will not synchronize at its end
    records a start event too."""
    return eng._timer.begin(eng.device.type == "cuda" and not needs_sync(eng, budget))


def needs_sync(eng, budget: Optional[int]) -> bool:
    """Whether the step's end must wait for the device. Its event timings (a detailed profile, a
    trace) and the device-inclusive step time the planner scales its estimates by are needed at
    once; with no budget nothing plans, nothing moved and nothing was timed, so the host goes on
    while the device finishes the step."""
    return budget is not None or eng._profiler.detailed


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _end_memory_step(eng, counters, failed: bool, oom: bool, calls: list) -> dict:
    """The device's side of the step for the budget derivation, as StepStats fields. Its size
    counts what recomputed blocks (``calls``, the runner's) would have saved kept beyond their
    inputs, which they saved: a step's size is then the same whatever mix it ran."""
    stats = torch.cuda.memory_stats(eng.device)
    peak = torch.cuda.max_memory_allocated(eng.device)
    r = eng._memory.end_step(
        saved_bytes=counters.saved_bytes, peak_allocated=peak,
        allocated_at_start=eng._allocated_at_start,
        peak_resident=counters.peak_resident_bytes,
        # Free bytes inside segments that also hold live blocks: unlike whole free segments,
        # the allocator cannot give them back when it runs short.
        fragmentation_bytes=stats.get("inactive_split_bytes.all.peak", 0),
        failed=failed, out_of_memory=oom,
        recomputed_bytes=sum(max(0, c.recomputed_bytes - c.input_bytes)
                             for c in calls if c.mode != "keep"))
    return dict(peak_device_bytes=peak, min_budget_bytes=r.min_budget_bytes,
                predicted_transient_bytes=r.predicted_transient_bytes,
                transient_bytes=r.transient_bytes, memory_tightened=r.tightened,
                memory_safety=r.safety, fragmentation_kept_bytes=r.fragmentation_bytes)


def _write_trace(eng, profile, stats: StepStats) -> None:
    measured = {k: getattr(stats, k) for k in (
        "step_seconds", "peak_resident_bytes", "budget_bytes", "stall_seconds",
        "offloaded_bytes", "sync_fetches", "forced_offloads", "plan_source")}
    # On CUDA the model state is what was allocated when the step began (weights, gradients,
    # optimizer states); on the CPU the engine cannot tell it from other memory: 0.
    write_step(eng._trace_dir, stats.step, profile, measured=measured,
               meta={"device": str(eng.device), "torch": torch.__version__,
                     "policy": eng.policy, "min_tensor_bytes": eng.config.min_tensor_bytes},
               link=eng._bandwidth(), model_state_bytes=eng._state_bytes)


def _warn_foreign(eng, counters) -> None:
    if counters.saved_bytes == 0 and counters.foreign_bytes > 0 and not eng._warned_foreign:
        eng._warned_foreign = True
        warnings.warn(f"chameleon-swap: this step saved {format_bytes(counters.foreign_bytes)} "
                      f"of activations on other devices than the engine's ({eng.device}); "
                      "pass device= to manage them", RuntimeWarning, stacklevel=5)

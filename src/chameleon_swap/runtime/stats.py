"""What ``Chameleon`` reports of its steps: ``StepStats`` (one step), the last few of them and
running totals.

A training run can last months of steps; keeping every step's figures would grow without bound,
so ``eng.history`` keeps the last ``history_size`` steps (default 1000) and ``eng.totals`` sums
every step since the engine was created.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..config import format_bytes


@dataclasses.dataclass
class StepStats:
    """What one ``eng.step()`` did. Bytes are bytes; seconds are wall-clock. ``step_seconds`` is
    always the step's device-inclusive time, or None while it is not known: on the CPU, and on
    CUDA for a step with a budget or a timed (detailed) one, the step ends with a
    synchronization and it is the measured wall time (the planner scales its slot estimates by
    it); on CUDA a step with no budget does not stall the host, and its time comes from CUDA
    events recorded at its start and end, read without synchronizing when a later step ends (or
    at ``close()``): until then, or if the end never completed in time, None. ``host_seconds``
    is what the host spent in the step, on every path."""

    step: int
    budget_bytes: Optional[int]        # this step's activation budget (None: unlimited)
    peak_resident_bytes: int           # most saved-activation bytes kept on the device at once
    saved_bytes: int                   # distinct storages saved for backward
    offloaded_bytes: int               # copied device -> host
    offloaded_tensors: int
    prefetched_bytes: int              # copied host -> device ahead of need
    fetched_bytes: int                 # copied host -> device on demand
    sync_fetches: int                  # tensors needed before their copy back had arrived
    late_prefetches: int               # of which: prefetched, but not early enough
    budget_waits: int                  # times a save had to wait for a copy-out to finish
    stall_seconds: float               # compute time lost waiting for copies
    step_seconds: Optional[float]      # device-inclusive; None: not known (yet), see above
    host_peak_bytes: int               # host buffer bytes in use at most (arena, all steps)
    skipped_bytes: int                 # parameters/buffers saved: never moved, not counted
    host_seconds: float = 0.0          # the host's time in the step (= step_seconds if synced)
    peak_device_bytes: Optional[int] = None   # CUDA max_memory_allocated, with device_memory_limit
    # With device_memory_limit (None otherwise): the budget is what the limit leaves once the
    # step's non-activation memory (logits, gradients, workspaces: the transient) is predicted.
    min_budget_bytes: Optional[int] = None    # lowest budget in force: below budget_bytes when
                                              # the step turned out larger than assumed at start
    predicted_transient_bytes: Optional[int] = None   # predicted for this step's size
    transient_bytes: Optional[int] = None     # measured: device peak - start - peak resident
    memory_tightened: bool = False     # the prediction was too small (or the step ran out of
                                       # memory): later steps leave more room
    memory_safety: Optional[float] = None       # the factor on predicted transients after it
    fragmentation_kept_bytes: Optional[int] = None  # kept free for fragmentation after it
    failed: bool = False               # the step ended with an exception
    # Adaptivity (profiler and plans).
    sequence_changed: bool = False     # differs from the previous step beyond the thresholds
                                       # (a lean step, and the one after it: its size does)
    plan_source: str = "guard"         # "guard" | "planned" | "cache" | "replanned" (made
                                       # again after its predictions missed the steps)
    predicted_stall_seconds: Optional[float] = None   # the applied plan's prediction
    # The applied plan's predicted step time, from the model that chose it (the mode plan's with
    # model=): a step that runs >10% over it twice for one size makes the engine correct its model
    # and plan again. None: no plan applied.
    predicted_step_seconds: Optional[float] = None
    profiler_seconds: float = 0.0      # host time the profiler took during this step
    # Host time the policy took once the step was over: learning from its profile and making
    # plans (swap plans; mode plans with model=). Not in step_seconds or host_seconds (the
    # planner's model is of the step itself), but in the wall time around ``with eng.step():``.
    planning_seconds: float = 0.0
    # The planner process's time on the mode plans that landed since the step before's report
    # (``plan_in_background``; they land as a step begins): spent beside the steps, on another
    # core, in none of their times; what planning on the step's thread would have added.
    background_planning_seconds: float = 0.0
    profile_mode: str = "lightweight"  # "lightweight" | "detailed" (timed)
    signature: str = ""                # exact hash of this step's operator sequence
    plan_overrides: int = 0            # tensors a plan kept that the guard had to move
    forced_offloads: int = 0           # saves copied out synchronously to hold the budget
    kept_bytes: int = 0                # copied out but needed before that copy completed: the
                                       # device copy was used, nothing had to come back
    host_allocated_bytes: int = 0      # host memory freshly allocated (pinned on CUDA) during the
                                       # step: new arena slabs; 0 once the arena is warm. Slabs
                                       # grown ahead on the background thread (and the
                                       # host_memory_reserve slab) count only if the step had to
                                       # wait for them; ready before it needed them, they belong
                                       # to no step
    host_wait_seconds: float = 0.0     # time the step waited for host memory: a slab allocated
                                       # on its own thread, or one on its way from the
                                       # background thread or host_memory_reserve
    host_deferred_moves: int = 0       # copy-outs the budget did not need yet, put off because no
                                       # host buffer was ready (the step would have waited for one):
                                       # moved at a later save, or kept resident
    # Recomputation (with model=): blocks run keep, selective or full this step.
    recomputed_bytes: int = 0          # activation bytes not kept because their block recomputes
    recompute_seconds: float = 0.0     # measured forward time repeated in backward
    block_modes: tuple = ()            # block calls that ran (keep, selective, full); () no model
    # "whole" where the step ran on the lean path to its end (a size its budget holds whole:
    # from its first block with model=, else from its second saved storage; every block kept,
    # no policy call per save, no profile), "tripped" where a save would have passed the
    # budget and the rest ran the executor's path; "" on the executor's path.
    lean: str = ""
    # Weight offload (PipelineChameleon(offload_weights=True)); None without it.
    weight_peak_bytes: Optional[int] = None   # most block-weight bytes on the device at once,
                                              # from the first block's forward on

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        parts = [f"step {self.step}",
                 f"peak {format_bytes(self.peak_resident_bytes)} / {format_bytes(self.budget_bytes)}",
                 f"out {format_bytes(self.offloaded_bytes)}",
                 f"back {format_bytes(self.prefetched_bytes + self.fetched_bytes)}",
                 f"sync {self.sync_fetches}",
                 f"stall {self.stall_seconds * 1e3:.1f} ms",
                 "step " + ("?" if self.step_seconds is None
                            else f"{self.step_seconds * 1e3:.1f} ms")]
        if self.peak_device_bytes is not None:
            parts.append(f"device peak {format_bytes(self.peak_device_bytes)}")
        if self.block_modes:
            k, sel, full = self.block_modes
            parts.append(f"blocks keep {k}/sel {sel}/full {full}, "
                         f"recompute {self.recompute_seconds * 1e3:.1f} ms")
        if self.weight_peak_bytes is not None:
            parts.append(f"weights peak {format_bytes(self.weight_peak_bytes)}")
        if self.min_budget_bytes is not None and self.min_budget_bytes != self.budget_bytes:
            parts.append(f"budget lowered to {format_bytes(self.min_budget_bytes)}")
        if self.memory_tightened:
            parts.append("memory tightened")
        if self.planning_seconds >= 1e-3:
            parts.append(f"planning {self.planning_seconds * 1e3:.1f} ms")
        if self.background_planning_seconds >= 1e-3:
            parts.append(f"planned beside {self.background_planning_seconds * 1e3:.1f} ms")
        if self.lean:
            parts.append("lean" + (", tripped" if self.lean == "tripped" else ""))
        parts.append(self.plan_source + (" (changed)" if self.sequence_changed else ""))
        return " | ".join(parts)


def block_stats(calls: list, with_model: bool, lean_calls: int = 0) -> dict:
    """StepStats' recompute figures from the runner's block calls (``lean_calls``: those that
    ran past it, kept, on a lean step)."""
    if not with_model:
        return {}
    modes = [c.mode for c in calls] + ["keep"] * lean_calls
    # What a recomputed block did not keep: what it re-creates, less what it still kept (its
    # inputs; under selective, also the matmul and attention outputs).
    return {"recomputed_bytes": sum(max(0, c.recomputed_bytes - c.selective_bytes - c.input_bytes)
                                    for c in calls if c.mode != "keep"),
            "recompute_seconds": sum(c.recompute_seconds or 0.0 for c in calls),
            "block_modes": (modes.count("keep"), modes.count("selective"), modes.count("full"))}


class StepHistory(list):
    """A list of the last ``maxlen`` StepStats, oldest first: appending to a full history drops
    the oldest. Everything else is a plain list (indexing, slicing, iteration)."""

    def __init__(self, maxlen: int) -> None:
        super().__init__()
        self.maxlen = maxlen

    def append(self, stats) -> None:
        super().append(stats)
        if len(self) > self.maxlen:
            del self[0]


@dataclasses.dataclass
class StepTotals:
    """Sums over every step the engine ran, including those no longer in ``history``."""

    steps: int = 0
    failed_steps: int = 0
    saved_bytes: int = 0
    offloaded_bytes: int = 0
    prefetched_bytes: int = 0
    fetched_bytes: int = 0
    sync_fetches: int = 0
    forced_offloads: int = 0
    recomputed_bytes: int = 0
    stall_seconds: float = 0.0
    step_seconds: float = 0.0              # steps whose time is known (see StepStats)
    host_seconds: float = 0.0
    profiler_seconds: float = 0.0
    planning_seconds: float = 0.0          # after the steps, outside their step_seconds
    background_planning_seconds: float = 0.0   # in the planner process, beside the steps
    peak_resident_bytes: int = 0           # the most of any step
    host_wait_seconds: float = 0.0
    host_deferred_moves: int = 0

    def add(self, st) -> None:
        self.steps += 1
        self.failed_steps += bool(st.failed)
        for name in ("saved_bytes", "offloaded_bytes", "prefetched_bytes", "fetched_bytes",
                     "sync_fetches", "forced_offloads", "recomputed_bytes", "stall_seconds",
                     "host_seconds", "profiler_seconds", "planning_seconds",
                     "background_planning_seconds",
                     "host_wait_seconds", "host_deferred_moves"):
            setattr(self, name, getattr(self, name) + getattr(st, name))
        if st.step_seconds is not None:      # else added when known (StepTimer.resolve)
            self.step_seconds += st.step_seconds
        self.peak_resident_bytes = max(self.peak_resident_bytes, st.peak_resident_bytes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

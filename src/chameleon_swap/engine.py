"""``Chameleon``: the user's object. Configuration, ``step()``, wiring, ``StepStats`` and history.

No policy logic lives here: the engine builds a copy engine, a host arena, an executor and a policy,
installs the hooks for the duration of a step, and turns the executor's counters into a
``StepStats`` at the end of it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import warnings
import weakref
from pathlib import Path
from typing import Iterator, Optional, Union

import torch

from .config import DEFAULT_MIN_TENSOR_BYTES, EngineConfig, SizeLike, format_bytes
from .copy import make_copy_engine
from .copy.bandwidth import cached_bandwidth, resolve_device
from .copy.host_pool import HostPool
from .executor import Executor
from .policy import make_policy
from .policy.memory import DeviceMemoryBudget
from .profiler import Profiler
from .sequence import similarity

log = logging.getLogger("chameleon_swap")


@dataclasses.dataclass
class StepStats:
    """What one ``eng.step()`` did. Bytes are bytes; seconds are wall-clock. On CUDA a step with
    a budget, or a timed (detailed) one, ends with a synchronization, so its ``step_seconds``
    include the device's work (the planner scales its slot estimates by it); a step with no
    budget needs no figure from the device and does not stall the host: its ``step_seconds``
    are the host's time only, and the device may still be running its tail."""

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
    step_seconds: float
    host_peak_bytes: int               # host buffer bytes in use at most (arena, all steps)
    skipped_bytes: int                 # parameters/buffers saved: never moved, not counted
    peak_device_bytes: Optional[int] = None   # CUDA max_memory_allocated, with device_memory_limit
    # With device_memory_limit (None otherwise): the budget is what the limit leaves once the
    # step's non-activation memory (logits, gradients, workspaces: the transient) is predicted.
    min_budget_bytes: Optional[int] = None    # lowest budget in force: below budget_bytes when
                                              # the step turned out larger than assumed at start
    predicted_transient_bytes: Optional[int] = None   # predicted for this step's size
    transient_bytes: Optional[int] = None     # measured: device peak - start - peak resident
    memory_tightened: bool = False     # the prediction was too small (or the step ran out of
                                       # memory): later steps leave more room
    failed: bool = False               # the step ended with an exception
    # Adaptivity (profiler and plans).
    sequence_changed: bool = False     # differs from the previous step beyond the thresholds
    plan_source: str = "guard"         # "guard" | "planned" | "cache"
    predicted_stall_seconds: Optional[float] = None   # the applied plan's prediction
    profiler_seconds: float = 0.0      # host time the profiler took during this step
    profile_mode: str = "lightweight"  # "lightweight" | "detailed" (timed)
    signature: str = ""                # exact hash of this step's operator sequence
    plan_overrides: int = 0            # tensors a plan kept that the guard had to move
    forced_offloads: int = 0           # saves copied out synchronously to hold the budget
    kept_bytes: int = 0                # copied out but needed before that copy completed: the
                                       # device copy was used, nothing had to come back
    host_allocated_bytes: int = 0      # host memory freshly allocated (pinned on CUDA) during the
                                       # step: new arena slabs; 0 once the arena is warm
    # Recomputation (with model=): blocks run keep, selective or full this step.
    recomputed_bytes: int = 0          # activation bytes not kept because their block recomputes
    recompute_seconds: float = 0.0     # measured forward time repeated in backward
    block_modes: tuple = ()            # block calls that ran (keep, selective, full); () no model

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        parts = [f"step {self.step}",
                 f"peak {format_bytes(self.peak_resident_bytes)} / {format_bytes(self.budget_bytes)}",
                 f"out {format_bytes(self.offloaded_bytes)}",
                 f"back {format_bytes(self.prefetched_bytes + self.fetched_bytes)}",
                 f"sync {self.sync_fetches}",
                 f"stall {self.stall_seconds * 1e3:.1f} ms",
                 f"step {self.step_seconds * 1e3:.1f} ms"]
        if self.peak_device_bytes is not None:
            parts.append(f"device peak {format_bytes(self.peak_device_bytes)}")
        if self.block_modes:
            k, sel, full = self.block_modes
            parts.append(f"blocks keep {k}/sel {sel}/full {full}, "
                         f"recompute {self.recompute_seconds * 1e3:.1f} ms")
        if self.min_budget_bytes is not None and self.min_budget_bytes != self.budget_bytes:
            parts.append(f"budget lowered to {format_bytes(self.min_budget_bytes)}")
        if self.memory_tightened:
            parts.append("memory tightened")
        parts.append(self.plan_source + (" (changed)" if self.sequence_changed else ""))
        return " | ".join(parts)


class Chameleon:
    """Keep the activations a training step saves for backward under a device-memory budget.

    Args:
        budget: bytes of saved activations that may be resident on the device at once (a tensor
            being copied out counts until its copy completes): an int or a size string
            ("512MB", "1.5GiB"); None means no limit.
        device: the device whose activations are managed ('cpu' or 'cuda[:N]'); default the
            current CUDA device if there is one, else the CPU.
        min_tensor_bytes: storages smaller than this stay resident (and counted) unless the
            budget cannot be held otherwise.
        device_memory_limit: CUDA only: a cap on all memory allocated on the device; each step's
            activation budget is what the limit leaves once what is allocated when it begins and
            the step's other memory (logits, gradients, workspaces), predicted from earlier steps
            of other sizes, are set aside; lowered during forward when the step turns out larger
            than the previous one (``StepStats.min_budget_bytes``, ``transient_bytes``,
            ``memory_tightened``). The first step, with nothing learnt, keeps activations in a
            quarter of what is free.
        policy: "chameleon" (the default: profiles every step, plans per operator sequence,
            adapts when it changes; the guard underneath), "guard" (no profile needed; holds the
            budget on any step) or "static" (one plan made after warm-up and frozen: the
            baseline of frozen peers); "schedule" is the guard ranking saved tensors by when a
            pipeline schedule needs them back (``chameleon_swap.pipeline`` sets it up; alone it
            behaves as "guard").
        host_memory_limit: most host memory offloaded activations may take; default half of the
            RAM available when the engine is created.
        host_memory_reserve: host memory to allocate (and pin, on CUDA) up front, as one slab of
            the host arena, so that early steps do not pay for pinning; an int or a size string,
            at most ``host_memory_limit``. It is allocated on a background thread: creating the
            engine does not wait, and the first offload that needs host memory before the slab
            is ready waits for it (never allocates beside it). None (default) reserves nothing:
            the arena then grows on demand, at least doubling each time.
        length_tolerance, min_similarity: a step's operator sequence counts as changed when its
            length differs by more than ``length_tolerance`` (relative) or the cosine similarity
            of the two sequences is below ``min_similarity``; defaults 5% and 0.95.
        plan_cache_size: plans kept, one per operator-sequence signature (LRU).
        model: the model being trained (optional). With it, the default policy also recomputes:
            the engine finds the model's repeated blocks and runs each, step by step, kept,
            selectively recomputed (matmul and attention outputs kept, the rest recomputed) or
            fully recomputed (only the block's inputs kept), whichever its plan predicts fastest
            under the budget together with the swaps. Nothing in the model changes; gradients
            stay bit-for-bit. ``policy="guard"`` and ``"static"`` stay swap-only.
        blocks: which blocks may be recomputed (with ``model=``): None finds them (Hugging Face
            ``_no_split_modules``, else the largest ``nn.ModuleList`` of one class), or a list of
            submodules, or the dotted name of a ``ModuleList`` (``"model.layers"``).
        link_bandwidth: bytes per second per direction the planner assumes for the host link
            (a number or ``"25GB/s"``); None (default) measures it. For what-if runs and tests.
        trace_dir: a directory (created if missing) that receives every step's trace for the
            simulator, ``step-<n>.json`` (``chameleon_swap.sim.load(trace_dir)`` reads them
            back): its slot times, saved tensors and what it measured. Every step is then
            profiled in detailed (timed) mode. None (default) writes nothing.

    Use it as a context manager, and mark each iteration (forward and backward) with ``step()``::

        with Chameleon(budget="6GiB") as eng:
            for batch in loader:
                with eng.step():
                    loss = model(batch)
                    loss.backward()
                opt.step(); opt.zero_grad()
    """

    def __init__(self, budget: SizeLike = None, *, device=None,
                 min_tensor_bytes: SizeLike = DEFAULT_MIN_TENSOR_BYTES,
                 device_memory_limit: SizeLike = None, policy: str = "chameleon",
                 host_memory_limit: SizeLike = None, host_memory_reserve: SizeLike = None,
                 length_tolerance: float = 0.05,
                 min_similarity: float = 0.95, plan_cache_size: int = 16,
                 trace_dir: Optional[Union[str, os.PathLike]] = None,
                 model: Optional[torch.nn.Module] = None, blocks=None,
                 link_bandwidth: Union[int, float, str, None] = None) -> None:
        self.config = EngineConfig(budget=budget, min_tensor_bytes=min_tensor_bytes,
                                   device_memory_limit=device_memory_limit, policy=policy,
                                   host_memory_limit=host_memory_limit,
                                   host_memory_reserve=host_memory_reserve,
                                   length_tolerance=length_tolerance, min_similarity=min_similarity,
                                   plan_cache_size=plan_cache_size, link_bandwidth=link_bandwidth)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module (the model being trained) or None; "
                            f"got {type(model).__name__}")
        if blocks is not None and model is None:
            raise ValueError("blocks= names blocks of a model: pass model= too")
        self._trace_dir = _trace_dir(trace_dir)   # checked before anything is allocated
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = resolve_device(device, "device")
        if self.config.device_memory_limit_bytes is not None and self.device.type != "cuda":
            raise ValueError(f"device_memory_limit caps CUDA memory, but this engine's device is "
                             f"{self.device}; use budget= to bound saved activations on the CPU")
        self._copy = make_copy_engine(self.device)
        # After the copy engine: on CUDA the context exists before the reserve thread pins.
        self._pool = HostPool(self.config.host_memory_limit_bytes, pin=self.device.type == "cuda",
                              reserve_bytes=self.config.host_memory_reserve_bytes)
        self._ex = Executor(self.device, self._copy, self._pool, self.config.min_tensor_bytes)
        self._profiler = Profiler(self.device)
        self._ex.profiler = self._profiler
        self._policy = make_policy(self.config.policy, self._ex,
                                   cache_size=self.config.plan_cache_size)
        self._policy.bandwidth_fn = self._bandwidth
        self._ex.policy = self._policy
        self._runner = self._make_runner(model, blocks)
        self._prev_ids: Optional[list] = None
        self._state_bytes = 0                     # device bytes allocated when a step began
        # Global module hooks, registered once for the engine's life and idle outside a step:
        # re-registering them every step would change the hook ids torch.compile guards on and
        # recompile every compiled module every step.
        # They hold the engine weakly, so an engine never closed can still be collected.
        self._hooks = [torch.nn.modules.module.register_module_forward_pre_hook(
                           _weak_hook(self._module_pre)),
                       torch.nn.modules.module.register_module_forward_hook(
                           _weak_hook(self._module_post))]
        weakref.finalize(self, _remove_hooks, list(self._hooks))
        self.history: list[StepStats] = []
        self._in_step = False
        self._closed = False
        self._module_starts: list[int] = []
        limit = self.config.device_memory_limit_bytes
        self._memory = DeviceMemoryBudget(limit) if limit is not None else None
        self._warned_foreign = False

    # ------------------------------------------------------------------ public state
    @property
    def budget_bytes(self) -> Optional[int]:
        return self.config.budget_bytes

    @property
    def policy(self) -> str:
        return self.config.policy

    @property
    def policy_object(self):
        """The policy instance this engine runs: for integrations that feed it what only they
        know (``chameleon_swap.pipeline`` tells the ``"schedule"`` policy when each backward
        comes)."""
        return self._policy

    @property
    def last_step(self) -> Optional[StepStats]:
        return self.history[-1] if self.history else None

    @property
    def host_bytes_in_use(self) -> int:
        """Host memory holding offloaded activations right now (0 between steps once the
        graphs are gone); free memory of the host arena is not counted."""
        return self._pool.in_use_bytes

    @property
    def host_bytes_reserved(self) -> int:
        """Host memory the arena holds, in use or free (pinned on CUDA); 0 once closed."""
        return self._pool.reserved_bytes

    @property
    def resident_bytes(self) -> int:
        return self._ex.resident_bytes

    def __repr__(self) -> str:
        return (f"Chameleon(budget={format_bytes(self.budget_bytes)}, device={self.device}, "
                f"policy={self.policy!r}, steps={len(self.history)})")

    def _bandwidth(self) -> tuple[float, float]:
        """(device->host, host->device) bytes per second for the planner: ``link_bandwidth``
        when given, else measured once."""
        given = self.config.link_bandwidth_bytes_per_s
        if given is not None:
            return given, given
        bw = cached_bandwidth(self.device)
        return bw.d2h_bytes_per_s, bw.h2d_bytes_per_s

    def _make_runner(self, model, blocks):
        """The recompute runner over the model's blocks (the default policy only; the others
        stay swap-only, but a bad ``blocks=`` is still an error for them)."""
        if model is None:
            return None
        from .recompute import BlockRunner, find_blocks
        if not getattr(self._policy, "recomputes", False):
            find_blocks(model, blocks)
            return None
        policy = self._policy
        # The model's blocks hold the runner; the runner holds the engine only weakly, so an
        # engine never closed can still be collected (its blocks then run keep).
        ref = weakref.WeakMethod(self._block_mode)
        runner = BlockRunner(model, blocks, mode_fn=lambda b: (ref() or _keep)(b),
                             accountant=self._ex, clock=self._profiler.clock)
        runner.working_set_fn = policy.working_set
        policy.modes.eligible = list(runner.eligible)
        runner.install()
        return runner

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Chameleon":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release every host buffer and hand the host arena back (saved tensors still held by
        a graph become unusable)."""
        if self._closed:
            return
        if self._in_step:
            raise RuntimeError("Chameleon.close() was called inside eng.step(); leave the step first")
        self._ex.release_all("the engine was closed")
        if self._runner is not None:
            self._runner.remove()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._copy.close()
        self._pool.close()
        self._closed = True

    # ------------------------------------------------------------------ one iteration
    @contextlib.contextmanager
    def step(self) -> Iterator["Chameleon"]:
        """Mark one training iteration (forward and backward) run under the budget."""
        if self._closed:
            raise RuntimeError("this Chameleon engine is closed; create a new one")
        if self._in_step:
            raise RuntimeError("eng.step() cannot be nested: one step is one iteration "
                               "(forward and backward); end the current step first")
        self._in_step = True
        budget = self._step_budget()
        self._ex.begin_step(budget)
        self._policy.begin_step()
        # A traced step is timed: the simulator needs every slot's duration.
        detailed = self._policy.wants_detail() or self._trace_dir is not None
        self._profiler.begin_step(detailed=detailed)
        if self._runner is not None:
            self._runner.begin_step(detailed)
        self._state_bytes = (torch.cuda.memory_allocated(self.device)
                             if self._trace_dir is not None and self.device.type == "cuda" else 0)
        self._module_starts = []
        self._host_allocated_at_start = self._pool.allocated_bytes
        t0 = time.perf_counter()
        failed = oom = False
        try:
            with torch.autograd.graph.saved_tensors_hooks(_eager(self._ex.pack),
                                                          _eager(self._ex.unpack)):
                yield self
        except BaseException as e:
            failed, oom = True, isinstance(e, _OOM)
            raise
        finally:
            self._finish_step(t0, budget, failed, oom)

    def _step_budget(self) -> Optional[int]:
        budget = self.config.budget_bytes
        if self._memory is not None:
            # The budget is what the limit leaves besides the step's predicted non-activation
            # memory (policy/memory.py); it is lowered in forward if the step turns out larger.
            self._allocated_at_start = torch.cuda.memory_allocated(self.device)
            budget = self._memory.begin_step(self._allocated_at_start, budget)
            torch.cuda.reset_peak_memory_stats(self.device)
        return budget

    def _end_memory_step(self, counters, failed: bool, oom: bool) -> dict:
        """The device's side of the step for the budget derivation, as StepStats fields."""
        stats = torch.cuda.memory_stats(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        r = self._memory.end_step(
            saved_bytes=counters.saved_bytes, peak_allocated=peak,
            allocated_at_start=self._allocated_at_start,
            peak_resident=counters.peak_resident_bytes,
            # Free bytes inside segments that also hold live blocks: unlike whole free segments,
            # the allocator cannot give them back when it runs short.
            fragmentation_bytes=stats.get("inactive_split_bytes.all.peak", 0),
            failed=failed, out_of_memory=oom)
        return dict(peak_device_bytes=peak, min_budget_bytes=r.min_budget_bytes,
                    predicted_transient_bytes=r.predicted_transient_bytes,
                    transient_bytes=r.transient_bytes, memory_tightened=r.tightened)

    def _finish_step(self, t0: float, budget: Optional[int], failed: bool,
                     oom: bool = False) -> None:
        try:
            counters = self._ex.end_step(failed)
            memory = {}
            if self._end_needs_sync(budget):
                self._sync_device()
            if self.device.type == "cuda" and self._memory is not None:
                memory = self._end_memory_step(counters, failed, oom)
            calls = self._runner.end_step(failed) if self._runner is not None else []
            step_seconds = time.perf_counter() - t0
            profile = self._profiler.finish(step_seconds)
            profile.blocks = calls
            changed = False
            if profile.ids:        # a step that saved nothing (eval under no_grad) changes nothing
                # The same sequence again (the common case) needs no histogram comparison.
                if self._prev_ids is not None and self._prev_ids != profile.ids:
                    changed = similarity(self._prev_ids, profile.ids).changed(
                        self.config.length_tolerance, self.config.min_similarity)
                self._prev_ids = profile.ids
            self._policy.end_step(None if failed else profile)
            report = self._policy.report()
            stats = StepStats(
                step=len(self.history), budget_bytes=budget,
                peak_resident_bytes=counters.peak_resident_bytes, saved_bytes=counters.saved_bytes,
                offloaded_bytes=counters.offloaded_bytes,
                offloaded_tensors=counters.offloaded_tensors,
                prefetched_bytes=counters.prefetched_bytes, fetched_bytes=counters.fetched_bytes,
                sync_fetches=counters.sync_fetches, late_prefetches=counters.late_prefetches,
                budget_waits=counters.budget_waits, stall_seconds=self._copy.take_stall_seconds(),
                step_seconds=step_seconds, host_peak_bytes=self._pool.peak_in_use_bytes,
                skipped_bytes=counters.skipped_bytes, failed=failed, **memory,
                sequence_changed=changed, plan_source=report["plan_source"],
                predicted_stall_seconds=report["predicted_stall_seconds"],
                profiler_seconds=profile.profiler_seconds,
                profile_mode="detailed" if profile.detailed else "lightweight",
                signature=profile.signature, plan_overrides=report["plan_overrides"],
                forced_offloads=counters.forced_offloads, kept_bytes=counters.kept_bytes,
                host_allocated_bytes=self._pool.allocated_bytes - self._host_allocated_at_start,
                **_block_stats(calls, self._runner is not None))
            self.history.append(stats)
            log.info("%s", stats)
            if self._trace_dir is not None and not failed:
                self._write_trace(profile, stats)
            if counters.saved_bytes == 0 and counters.foreign_bytes > 0 and not self._warned_foreign:
                self._warned_foreign = True
                warnings.warn(f"chameleon-swap: this step saved {format_bytes(counters.foreign_bytes)} "
                              f"of activations on other devices than the engine's ({self.device}); "
                              "pass device= to manage them", RuntimeWarning, stacklevel=4)
        finally:
            self._in_step = False

    def _end_needs_sync(self, budget: Optional[int]) -> bool:
        """Whether the step's end must wait for the device. Its event timings (a detailed
        profile, a trace) and the device-inclusive step time the planner scales its estimates by
        are needed at once; with no budget nothing plans, nothing moved and nothing was timed, so
        the host goes on while the device finishes the step."""
        return budget is not None or self._profiler.detailed

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _write_trace(self, profile, stats: StepStats) -> None:
        from .sim.trace import write_step
        measured = {k: getattr(stats, k) for k in (
            "step_seconds", "peak_resident_bytes", "budget_bytes", "stall_seconds",
            "offloaded_bytes", "sync_fetches", "forced_offloads", "plan_source")}
        # On CUDA the model state is what was allocated when the step began (weights, gradients,
        # optimizer states); on the CPU the engine cannot tell it from other memory: 0.
        write_step(self._trace_dir, stats.step, profile, measured=measured,
                   meta={"device": str(self.device), "torch": torch.__version__,
                         "policy": self.policy, "min_tensor_bytes": self.config.min_tensor_bytes},
                   link=self._bandwidth(), model_state_bytes=self._state_bytes)

    # ------------------------------------------------------------------ module hooks
    def _block_mode(self, b: int) -> str:
        return self._policy.block_mode(b, self._runner.input_bytes)

    def _recomputing(self) -> bool:
        return self._runner is not None and self._runner.recomputing

    def _module_pre(self, module: torch.nn.Module, args) -> None:
        if not self._in_step or _is_compiling() or self._recomputing():
            return
        self._ex.protect_buffers(module)
        self._module_starts.append(self._ex.next_index)
        if self._memory is not None:
            lowered = self._memory.on_progress(self._ex.stats.saved_bytes)
            if lowered is not None:
                self._ex.budget = lowered     # the step is larger than assumed: hold more off
        self._profiler.module_enter(module)

    def _module_post(self, module: torch.nn.Module, args, output) -> None:
        if not self._in_step or _is_compiling() or self._recomputing():
            return
        self._profiler.module_exit(module)
        start = self._module_starts.pop() if self._module_starts else 0
        # With no budget nothing comes back in backward, so no trigger is needed: a tensor hook
        # costs about as much as a pack, registered here and called again in backward.
        if self._ex.budget is None or self._ex.next_index == start or not torch.is_grad_enabled():
            return
        t = _first_grad_output(output)
        if t is not None:
            # Fires when the gradient of this module's output is ready: just before backward
            # reaches the tensors this module saved.
            t.register_hook(self._ex.backward_trigger)


def _keep(b: int) -> str:
    return "keep"


def _block_stats(calls: list, with_model: bool) -> dict:
    """StepStats' recompute figures from the runner's block calls."""
    if not with_model:
        return {}
    modes = [c.mode for c in calls]
    # What a recomputed block did not keep: what it re-creates, less what it still kept (its
    # inputs; under selective, also the matmul and attention outputs).
    return {"recomputed_bytes": sum(max(0, c.recomputed_bytes - c.selective_bytes - c.input_bytes)
                                    for c in calls if c.mode != "keep"),
            "recompute_seconds": sum(c.recompute_seconds or 0.0 for c in calls),
            "block_modes": (modes.count("keep"), modes.count("selective"), modes.count("full"))}


def _trace_dir(value) -> Optional[Path]:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"trace_dir must be a directory path (str or os.PathLike) or None; "
                        f"got {type(value).__name__} {value!r}")
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise ValueError(f"trace_dir must be a directory; {str(path)!r} is a file")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _eager(fn):
    """Keep torch.compile from tracing into the engine's hooks: they run eagerly (one graph break
    each) instead of being inlined, so dynamo never holds the engine's objects in its tracing
    state nor guards on them."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


def _weak_hook(method):
    # A weak reference to the object and the plain function: cheaper per call than a
    # WeakMethod, which builds a new bound method every time (these run on every module call).
    ref, fn = weakref.ref(method.__self__), method.__func__

    def hook(*args):
        obj = ref()
        if obj is not None:
            return fn(obj, *args)
    return _eager(hook)


def _remove_hooks(hooks) -> None:
    for h in hooks:
        h.remove()


# Inside torch.compile's tracing the module hooks step aside (no graph breaks): the compiled
# region's saved tensors still go through the pack/unpack hooks, which run eagerly.
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)
_OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def _first_grad_output(output) -> Optional[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return output if output.grad_fn is not None else None
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        for o in output:
            t = _first_grad_output(o)
            if t is not None:
                return t
    return None

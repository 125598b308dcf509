"""``Chameleon``: the user's object. Configuration, ``step()`` and wiring (``StepStats``, history
and totals live in ``runtime/stats.py``; the end of a step, which builds them, in
``runtime/step_end.py``; the global module hooks in ``runtime/module_hooks.py``).

Why one file (over 400 lines): a third of it is ``Chameleon``'s docstring, the reference of every
argument a user passes; the rest is the wiring, which reads best next to it.

No policy logic lives here: the engine builds a copy engine, a host arena, an executor and a policy,
installs the hooks for the duration of a step, and turns the executor's counters into a
``StepStats`` at the end of it.
"""
from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Iterator, Optional, Union

import torch

from .runtime import interrupts, module_hooks
from .config import (DEFAULT_HISTORY_SIZE, DEFAULT_HOST_FRACTION, DEFAULT_MIN_TENSOR_BYTES,
                     EngineConfig, SizeLike, format_bytes, trace_dir_path)
from .copy import make_copy_engine
from .copy.bandwidth import cached_bandwidth, resolve_device
from .runtime._eager import eager, top_saved_hooks as _top_hooks
from .copy.host_pool import HostPool, bytes_held_by_closed_arenas
from .runtime.executor import Executor
from .runtime.stats import StepHistory, StepStats, StepTotals
from .policy import make_policy
from .policy.memory import DeviceMemoryBudget
from .runtime.profiler import Profiler
from .runtime.step_end import StepTimer, begin_timing, finish_step


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
            (a number or ``"25GB/s"``); None (default) measures it. For what-if runs and tests:
            with it, plans are not checked against the steps (``predicted_step_seconds`` is
            still reported), since the steps do not run on that link.
        emulate_link: CPU only. Makes every copy between "device" and "host" take as long as a
            link of this bandwidth would (a number or ``"200MB/s"``): the bytes move at once and
            the copy counts as done when the link would have carried them, queued behind the
            copies ahead of it (``copy/cpu.py``); a step waits only for a copy it needs. A
            what-if and testing option: on a CPU, where a copy is a memmove the step hides, it
            reproduces a GPU's ratio of bytes to compute, so stalls, plans and the choice to
            recompute can be seen and tested. The planner then assumes this bandwidth unless
            ``link_bandwidth`` says otherwise. None (default): plain copies.
        plan_in_background: with ``model=``, a step size's mode plan (the search over keep,
            selective and full per block) is made in a planner process, a plain Python process
            started at the first plan (no torch, no device; ended by ``close()``), while the
            next steps run: the plan applies from the first step that begins after it is made,
            and until then the size runs what it ran. True (default); False makes each plan on
            the step's thread as the step ends, applied from the next step on (the same search
            on the same inputs; only where it runs, and so when a plan applies, differs). Where
            the process cannot run, plans are made on the step's thread.
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
                 link_bandwidth: Union[int, float, str, None] = None,
                 history_size: int = DEFAULT_HISTORY_SIZE,
                 emulate_link: Union[int, float, str, None] = None,
                 plan_in_background: bool = True) -> None:
        self.config = EngineConfig(budget=budget, min_tensor_bytes=min_tensor_bytes,
                                   device_memory_limit=device_memory_limit, policy=policy,
                                   host_memory_limit=host_memory_limit,
                                   host_memory_reserve=host_memory_reserve,
                                   length_tolerance=length_tolerance, min_similarity=min_similarity,
                                   plan_cache_size=plan_cache_size, link_bandwidth=link_bandwidth,
                                   history_size=history_size, emulate_link=emulate_link,
                                   plan_in_background=plan_in_background)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module (the model being trained) or None; "
                            f"got {type(model).__name__}")
        if blocks is not None and model is None:
            raise ValueError("blocks= names blocks of a model: pass model= too")
        self._trace_dir = trace_dir_path(trace_dir)   # checked before anything is allocated
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = resolve_device(device, "device")
        if self.config.device_memory_limit_bytes is not None and self.device.type != "cuda":
            raise ValueError(f"device_memory_limit caps CUDA memory, but this engine's device is "
                             f"{self.device}; use budget= to bound saved activations on the CPU")
        if host_memory_limit is None:
            # Half the RAM available, not counting what closed engines' arenas still hold.
            self.config.host_memory_limit_bytes += int(
                bytes_held_by_closed_arenas() * DEFAULT_HOST_FRACTION)
        emulated = self.config.emulate_link_bytes_per_s
        if emulated is not None and self.device.type != "cpu":
            raise ValueError(f"emulate_link slows the CPU copy engine's copies, but this engine's "
                             f"device is {self.device}; on a GPU the link is real (use "
                             f"link_bandwidth= to plan for another one)")
        self._copy = make_copy_engine(self.device, **({} if emulated is None
                                                      else {"bytes_per_s": emulated}))
        # After the copy engine: on CUDA the context exists before the reserve thread pins.
        # ahead=True: the arena grows ahead of use on a background thread (issue 19).
        self._pool = HostPool(self.config.host_memory_limit_bytes, pin=self.device.type == "cuda",
                              reserve_bytes=self.config.host_memory_reserve_bytes, ahead=True)
        limit = self.config.device_memory_limit_bytes
        # Nothing can ever move: no budget now or later (a memory limit derives one per step),
        # no blocks to recompute, no trace to time. Such an engine takes the resident-only hooks
        # (resident.py) and no module hooks but the buffer one.
        self._resident_only = (self.config.budget_bytes is None and limit is None
                               and model is None and self._trace_dir is None)
        self._ex = Executor(self.device, self._copy, self._pool, self.config.min_tensor_bytes,
                            resident_only=self._resident_only)
        self._profiler = Profiler(self.device)
        self._profiler.saves_only = self._resident_only
        self._ex.profiler = self._profiler
        self._copy.stall_slot = self._profiler.wait_slot      # waits kept apart from compute
        if self.device.type == "cpu":
            self._copy.clock = self._profiler.clock.mark          # ... on the profiler's clock
        self._policy = make_policy(self.config.policy, self._ex,
                                   cache_size=self.config.plan_cache_size)
        self._policy.bandwidth_fn = self._bandwidth
        checks = getattr(self._policy, "checks", None)
        if checks is not None:           # a what-if link cannot be checked against the steps
            checks.enabled = self.config.link_bandwidth_bytes_per_s is None
        self._ex.policy = self._policy
        self._runner = self._make_runner(model, blocks)
        self._model = weakref.ref(model) if model is not None else None   # (its buffers: _go_lean)
        self._prev_ids: Optional[list] = None
        self._prev_size: Optional[tuple] = None     # (size key, ran lean) of the last step
        self._state_bytes = 0                     # device bytes allocated when a step began
        self._hooks = module_hooks.register(self, self._resident_only)
        # The list itself, not a copy: ``module_hooks.paused`` puts new handles in it.
        weakref.finalize(self, module_hooks.remove, self._hooks)
        # A step of a size the budget holds whole runs on the lean path (``policy/lean.py``):
        # with model=, from its first block on (``_block_mode``), else from its second saved
        # storage (``_first_save``); the default policy only, and not with a memory limit (its
        # budget moves within the step, counted at module calls) or a trace (a traced step is
        # timed save by save).
        self._lean_ok = (self.config.policy == "chameleon" and limit is None
                         and self._trace_dir is None and self.config.budget_bytes is not None)
        self._lean_step = False                   # this step went lean (and may have tripped)
        self._lean_from = 0
        self._aside: Optional[module_hooks.Quiet] = None   # its module hooks out of the way
        if self._lean_ok:
            self._policy.modes.lean_sizes.on = True
        if self._resident_only or self._lean_ok:
            from .runtime.resident import resident_hooks
            self._ex.pack, self._ex.unpack = resident_hooks(self._ex)
            me = weakref.ref(self)                # (the executor holds the engine weakly)
            self._ex.on_trip = lambda: (me() or _Gone)._trip()
            if self._lean_ok and self._runner is None:
                self._ex.on_first = lambda t: (me() or _Gone)._first_save(t)
        self._saved_hooks: tuple = ()             # (pack, unpack, their eager wrappers)
        self.history: StepHistory = StepHistory(self.config.history_size)
        self.totals = StepTotals()
        self._timer = StepTimer(self.device)       # step_seconds from events, a step late
        self._in_step = False
        self._owner: dict = {}                    # "step": (thread id, token) of the open step
        self._step_hooks: Optional[tuple] = None  # this step's (pack, unpack) hooks
        self._closed = False
        self._module_starts: list[int] = []
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
        know (``chameleon_swap.parallel.pipeline`` tells the ``"schedule"`` policy when each backward
        comes)."""
        return self._policy

    @property
    def last_step(self) -> Optional[StepStats]:
        return self.history[-1] if self.history else None

    @property
    def host_bytes_in_use(self) -> int:
        """Host memory holding offloaded activations right now (0 between steps once the
        graphs are gone); free memory of the host arena is not counted."""
        self._settle()
        return self._pool.in_use_bytes

    @property
    def host_bytes_reserved(self) -> int:
        """Host memory the arena holds, in use or free (pinned on CUDA); 0 once closed. Bounded
        by ``host_memory_limit`` and, at each step's end, trimmed to the most any of the last
        32 steps had in use (or ``host_memory_reserve``, if larger)."""
        self._settle()
        return self._pool.reserved_bytes

    @property
    def resident_bytes(self) -> int:
        """Saved-activation bytes the engine counts on the device now (0 between steps once the
        graphs are gone)."""
        self._settle()
        return self._ex.resident_bytes

    @property
    def records_alive(self) -> int:
        """Saved storages the engine tracks now: those of graphs still alive (0 once they are
        gone)."""
        self._settle()
        return len(self._ex.live)

    def _settle(self) -> None:
        """Between steps, make the counters whole after an interrupt (see _recover)."""
        if not self._in_step and not self._closed:
            self._recover()

    def __repr__(self) -> str:
        return (f"Chameleon(budget={format_bytes(self.budget_bytes)}, device={self.device}, "
                f"policy={self.policy!r}, steps={len(self.history)})")

    def _bandwidth(self) -> tuple[float, float]:
        """(device->host, host->device) bytes per second for the planner: ``link_bandwidth``
        when given, else the emulated link's, else measured once."""
        given = self.config.link_bandwidth_bytes_per_s or self.config.emulate_link_bytes_per_s
        if given is not None:
            return given, given
        bw = cached_bandwidth(self.device)
        return bw.d2h_bytes_per_s, bw.h2d_bytes_per_s

    def _unsaved_bytes(self) -> int:
        """What the step's recomputed blocks have not saved so far (``BlockModes.unsaved``)."""
        modes = getattr(self._policy, "modes", None)
        return modes.unsaved() if modes is not None else 0

    def _block_mode(self, b: int) -> str:
        mode = self._policy.block_mode(b, self._runner.input_bytes)
        if self._lean_ok and self._policy.modes.lean and not self._lean_step:
            self._go_lean()
        return mode

    def _first_save(self, t: torch.Tensor) -> None:
        """The step's first saved storage, without model= (``Executor.on_first``): its shape
        and dtype key the step's size (an LLM's first save is its token ids)."""
        sizes = self._policy.modes.lean_sizes
        sizes.key = (tuple(t.shape), t.dtype)
        if sizes.wants(sizes.key, self._ex.budget):
            self._policy.modes.lean = True
            self._go_lean()

    def _go_lean(self) -> None:
        """The budget holds this step's size whole: the rest of it runs as an engine that never
        moves runs (``runtime/resident.py``), its blocks kept, its module calls past the engine
        (its global module hooks out of the way, the model's buffers checked once), no policy
        call per save, no profile."""
        ex = self._ex
        with ex.lock:
            ex.lean_limit, ex.lean = ex.budget, True
        self._lean_from = len(self._profiler.nbytes)     # saves seen before it
        self._lean_step = True
        if self._runner is not None:
            self._runner.lean = True
        # Its module calls need nothing of the engine but the buffer check, made here for every
        # buffer of the model (with model=; about 100 modules, tens of microseconds), so the
        # global module hooks step aside (``module_hooks.Quiet``, where nothing can tell) and
        # those calls take torch's fast path. Measured on this project's 2-core CPU (the
        # emulated-link benchmark's HF Llama 256x8 at 75% of 512 tokens' peak, the compute
        # thread's time over 30 interleaved rounds, the plain step's multiple, four runs each):
        # 256 tokens, whole, 1.060 with the hooks in, 1.055 aside; 384, tripping near its end,
        # 1.051 and 1.046; seven of the eight runs favoured aside, one tied. Small (the lean
        # hooks' per-save work is the rest of the gap), and it costs nothing else. A buffer of
        # a module outside the model (or of any module, without model=) first saved after this
        # counts as an activation (the lean path never moves it): on the budget's side.
        model = self._model() if self._model is not None else None
        if model is not None:
            for m in model.modules():
                if m._buffers:
                    ex.protect_buffers(m)
        self._aside = module_hooks.Quiet(self, False)
        self._aside.__enter__()

    def _step_back(self) -> None:
        """The global module hooks back in place after a lean step (or its trip)."""
        aside, self._aside = self._aside, None
        if aside is not None:
            aside.__exit__(None, None, None)

    def _trip(self) -> None:
        """A lean step's save would pass the budget (``Executor.on_trip``): the executor's own
        path from there on, the policy holding the budget as on a step it has no plan for."""
        from .policy.lean import trip
        self._step_back()                # (its buffer check from here on, as before the lean path)
        trip(self._policy)

    def _make_runner(self, model, blocks):
        """The recompute runner over the model's blocks (the default policy only; the others
        stay swap-only, but a bad ``blocks=`` is still an error for them)."""
        if model is None:
            return None
        from .recompute.runner import BlockRunner, find_blocks
        if not getattr(self._policy, "recomputes", False):
            find_blocks(model, blocks)
            return None
        policy = self._policy
        # The model's blocks hold the runner; the runner holds the engine only weakly, so an
        # engine never closed can still be collected (its blocks then run keep).
        ref = weakref.WeakMethod(self._block_mode)
        runner = BlockRunner(model, blocks, mode_fn=lambda b: (ref() or _keep)(b),
                             accountant=self._ex, clock=self._profiler.clock,
                             apart_fn=self._profiler.apart_mark)
        runner.working_set_fn = policy.working_set
        runner.count_kept_fn = policy.host_room.unknown     # (host_room.py)
        # Its full blocks run with the engine's module hooks out of the way where that is safe.
        me = weakref.ref(self)
        runner.quiet_hooks = lambda forward: module_hooks.Quiet(me(), forward)
        policy.modes.eligible = list(runner.eligible)
        policy.modes.selective_safe = runner.selective_safe
        policy.modes.views.param_shapes = frozenset(
            s for p in model.parameters() if p.dim() >= 2
            for s in (tuple(p.shape), tuple(p.shape)[::-1]))
        if self.config.plan_in_background:
            from .policy.background import Worker
            policy.modes.worker = Worker()          # (its process starts with the first plan)
        runner.install(probe=False)      # its probe runs in the engine's pre hook (module_hooks)
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
        self._recover()
        self._ex.release_all("the engine was closed")
        self._ex.settle()
        if self._runner is not None:
            self._runner.remove()
            worker = self._policy.modes.worker
            if worker is not None:
                worker.close()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._copy.close()
        self._pool.close()
        self._timer.resolve(self.totals)         # the last steps' times, if their ends completed
        self._closed = True

    # ------------------------------------------------------------------ one iteration
    @contextlib.contextmanager
    def step(self) -> Iterator["Chameleon"]:
        """Mark one training iteration (forward and backward) run under the budget.

        An exception (a Ctrl-C included) anywhere in the step, its set-up or its end releases
        what the step saved, and only that: graphs kept from earlier steps stay valid. What an
        interrupt cut short is finished at the next step's start (or ``close()``)."""
        if self._closed:
            raise RuntimeError("this Chameleon engine is closed; create a new one")
        mine = (threading.get_ident(), object())
        # From here on, whatever is interrupted, the finally gives the step back.
        try:
            owner = self._owner.setdefault("step", mine)     # atomic: one step at a time
            if owner is not mine:
                mine = None
                self._refuse_step(owner)
            self._in_step = True
            self._recover()
            self._raise_swallowed_interrupt()
            budget = self._step_budget()
            self._lean_step = False
            self._ex.begin_step(budget)
            self._policy.begin_step()
            # A traced step is timed: the simulator needs every slot's duration.
            detailed = self._policy.wants_detail() or self._trace_dir is not None
            self._profiler.begin_step(detailed=detailed)
            if self._runner is not None:
                self._runner.begin_step(detailed)
            self._state_bytes = (torch.cuda.memory_allocated(self.device)
                                 if self._trace_dir is not None and self.device.type == "cuda"
                                 else 0)
            self._module_starts = []
            self._host_allocated_at_start = self._pool.allocated_bytes
            self._host_wait_at_start = self._pool.wait_seconds
            t0 = begin_timing(self, budget)
            failed = oom = False
            self._step_hooks = self._saved_tensor_hooks()
            try:
                with torch.autograd.graph.saved_tensors_hooks(*self._step_hooks):
                    yield self
            except BaseException as e:
                failed, oom = True, isinstance(e, _OOM)
                raise
            finally:
                self._step_back()
                finish_step(self, t0, budget, failed, oom)
            self._raise_swallowed_interrupt()
        finally:
            if mine is not None and self._owner.get("step") is mine:
                self._step_back()        # (an interrupt before the inner one ran it)
                self._in_step = False
                del self._owner["step"]
                self._pop_stale_hooks()

    def _pop_stale_hooks(self) -> None:
        """An interrupt that lands as the step's saved-tensor hooks are being removed (at the
        entry of their ``__exit__``) leaves them installed on this thread: every later autograd
        save would go through a step that has ended. Take them off."""
        hooks, self._step_hooks = self._step_hooks, None
        if hooks is None or _top_hooks is None:
            return
        top = _top_hooks(False)
        if top is not None and top[0] is hooks[0]:
            torch._C._autograd._pop_saved_tensors_default_hooks()

    def _raise_swallowed_interrupt(self) -> None:
        """A Ctrl-C that landed in a saved tensor's release (inside ``__del__``, where Python
        would swallow it: caught there, or escaped to ``interrupts``' hook) is raised here, once
        the step is whole again."""
        if interrupts.take_pending():
            raise KeyboardInterrupt("interrupted while chameleon-swap released a saved tensor")

    def _refuse_step(self, owner) -> None:
        if owner[0] == threading.get_ident():
            raise RuntimeError("eng.step() cannot be nested: one step is one iteration "
                               "(forward and backward); end the current step first")
        raise RuntimeError("eng.step() is already running on another thread: one Chameleon "
                           "engine serves one training loop at a time (its budget, hooks and "
                           "counters are per step); create one engine per thread")

    def _recover(self) -> None:
        """Before a step (or close): finish what an interrupt cut short in an earlier step's
        set-up or end. The recompute runner ends the step it never ended (releasing its holds);
        with it, no hold outlives a step; the executor settles (Executor.settle)."""
        self._pop_stale_hooks()
        if self._runner is not None:
            if self._runner.in_step:
                self._runner.end_step(True)
            self._ex.release_holds()
        self._ex.settle()

    def _saved_tensor_hooks(self) -> tuple:
        """The executor's pack and unpack hooks, kept out of torch.compile (``eager``); looked up
        at every step (tests wrap them), wrapped again only when they changed."""
        pack, unpack = self._ex.pack, self._ex.unpack
        if self._saved_hooks[:2] != (pack, unpack):
            self._saved_hooks = (pack, unpack, eager(pack), eager(unpack))
        return self._saved_hooks[2:]

    def _step_budget(self) -> Optional[int]:
        budget = self.config.budget_bytes
        if self._memory is not None:
            # The budget is what the limit leaves besides the step's predicted non-activation
            # memory (policy/memory.py); it is lowered in forward if the step turns out larger.
            self._allocated_at_start = torch.cuda.memory_allocated(self.device)
            budget = self._memory.begin_step(self._allocated_at_start, budget)
            torch.cuda.reset_peak_memory_stats(self.device)
        return budget


class _Gone:
    """An engine collected mid-step: nothing to tell."""
    @staticmethod
    def _trip() -> None:
        pass

    @staticmethod
    def _first_save(t) -> None:
        pass


def paused_hooks(engines):
    """A context manager: the global module hooks of ``engines`` (between their steps) out
    meanwhile, for side-by-side comparisons in one process (``runtime.module_hooks.paused``)."""
    return module_hooks.paused(engines)


def _keep(b: int) -> str:
    return "keep"


_OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError

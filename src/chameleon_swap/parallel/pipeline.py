"""Pipeline parallelism with device memory used as a cache: one engine per rank, on
``torch.distributed.pipelining``.

Under 1F1B the first stage holds the activations of as many micro-batches as there are stages
while the last holds one, and the first stage's micro-batch 0, saved first, is needed back first.
``PipelineChameleon`` runs a :class:`~chameleon_swap.Chameleon` on each rank with the
``"schedule"`` policy: it reads the schedule's order for this rank, tags every saved activation
with its (stage, micro-batch), copies out first those whose backward is farthest away, and copies
back, after every action of the schedule and during backward, in the order the coming backwards
need them. The budget holds on every rank and every step; gradients are bit-for-bit those without
it. ``ScheduleChronos`` is a V-shaped schedule (see ``parallel/schedules``) expressed through
PyTorch's custom-schedule runtime; PyTorch's own ``Schedule1F1B`` and ``ScheduleGPipe`` work as
they are. The pipeline runtime is PyTorch's: nothing here sends, receives or orders work.

Per rank, in a few lines::

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from chameleon_swap.parallel.pipeline import PipelineChameleon

    stage = PipelineStage(my_part_of_the_model, rank, world, device)
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    with PipelineChameleon(schedule, budget="6GiB") as eng:   # or device_memory_limit="70GiB"
        for x, y in loader:
            with eng.step():               # one schedule step: all micro-batches on this rank
                if rank == 0:
                    schedule.step(x, target=y)
                else:
                    schedule.step(target=y)
            opt.step(); opt.zero_grad()
            print(eng.last_step)           # this rank's StepStats: peak, moved bytes, ...

With ``ScheduleChronos`` each rank builds two stages, ``chronos_stage_indices(rank, world)``,
and passes both: ``ScheduleChronos([s_lo, s_hi], n_microbatches=8, loss_fn=loss_fn)``.

A new schedule object (say, for another sequence length) is taken up with ``eng.attach(schedule)``
between steps.

For stages holding more layers than fit, ``PipelineChameleon(schedule, budget,
offload_weights=True)`` also keeps each stage's block weights on the host between their uses
inside a step (:class:`~chameleon_swap.parallel.weights.WeightOffload`): about two blocks' weights on the
device during the step, every parameter back on it between steps.
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Iterator

from torch.distributed.pipelining.schedules import (
    _Action,
    _ComputationType,
    _PipelineScheduleRuntime,
)

from ..engine import Chameleon
from .schedules import make_schedule, stage_ranks

_BACKWARDS = (_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_INPUT)


def chronos_stage_indices(rank: int, world: int) -> tuple[int, int]:
    """The two stages rank ``rank`` of ``world`` builds for :class:`ScheduleChronos`: the
    shallow one (``rank``) and the deep one (``2 * world - 1 - rank``), of ``2 * world``."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world={world}); got {rank!r}")
    return rank, 2 * world - 1 - rank


class ScheduleChronos(_PipelineScheduleRuntime):
    """The V-shaped Chronos order (``parallel/schedules``, ``"chronos"``) on PyTorch's schedule
    runtime: exactly two stages per rank, placed by :func:`chronos_stage_indices`; full backwards.
    Arguments are those of PyTorch's multi-stage schedules."""

    def __init__(self, stages, n_microbatches: int, loss_fn=None, **kwargs) -> None:
        stages = list(stages)
        if len(stages) != 2:
            raise ValueError(f"ScheduleChronos needs exactly two stages per rank (see "
                             f"chronos_stage_indices); got {len(stages)}")
        world, rank = stages[0].group_size, stages[0].group_rank
        want = sorted(chronos_stage_indices(rank, world))
        got = sorted(s.stage_index for s in stages)
        if got != want:
            raise ValueError(f"rank {rank} of {world} must hold stages {want} for ScheduleChronos; "
                             f"got stages {got}")
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn, **kwargs)
        self.stage_index_to_group_rank = dict(enumerate(stage_ranks("chronos", world)))
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank
        plan = make_schedule("chronos", world, n_microbatches)
        kinds = {"F": _ComputationType.FORWARD, "B": _ComputationType.FULL_BACKWARD}
        self.pipeline_order = {r: [_Action(op.stage, kinds[op.kind], op.mb) for op in order]
                               for r, order in enumerate(plan.orders)}
        self._prepare_schedule_with_comms(self.pipeline_order)


def _schedule_stages(schedule) -> list:
    """The stages a PyTorch schedule runs on this rank (single- and multi-stage schedules)."""
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stage = getattr(schedule, "_stage", None)
        stages = [] if stage is None else [stage]
    if not stages:
        raise TypeError(f"schedule must be a torch.distributed.pipelining schedule holding this "
                        f"rank's stages; got {type(schedule).__name__}")
    return list(stages)


def schedule_positions(schedule) -> dict[tuple[int, int], int]:
    """(stage, micro-batch) -> position of its backward in this rank's order of ``schedule``."""
    stages = _schedule_stages(schedule)
    rank = stages[0].group_rank
    order = getattr(schedule, "pipeline_order", None)
    if order and rank in order:
        return {(a.stage_index, a.microbatch_index): i for i, a in enumerate(order[rank])
                if a is not None and a.computation_type in _BACKWARDS}
    # A schedule that publishes no order: assume backwards in micro-batch order.
    return {(s.stage_index, mb): mb for s in stages for mb in range(schedule._n_microbatches)}


def _stage_blocks(module) -> list:
    """The blocks of one stage whose weights are offloaded: its repeated blocks, else its
    children (a stage of unlike layers)."""
    from ..recompute.blocks import find_blocks
    try:
        return find_blocks(module)
    except ValueError:
        children = [c for c in module.children() if any(True for _ in c.parameters())]
        if not children:
            raise ValueError(f"offload_weights=True: the stage's {type(module).__name__} has "
                             "no repeated blocks and no child module with parameters to "
                             "offload") from None
        return children


def _check_full_backwards(schedule, stages) -> None:
    """Weight offload brings a block back when the gradient reaches its outputs; a schedule
    that computes weight gradients in an action of their own (zero bubble) would run it on
    released weights."""
    order = getattr(schedule, "pipeline_order", None) or {}
    for actions in order.values():
        for a in actions:
            if a is not None and a.computation_type == _ComputationType.BACKWARD_WEIGHT:
                raise ValueError(f"offload_weights=True needs a schedule with full backwards; "
                                 f"{type(schedule).__name__} splits input and weight gradients "
                                 f"(action {a}); use Schedule1F1B, ScheduleGPipe, "
                                 f"ScheduleInterleaved1F1B or ScheduleChronos")


class PipelineChameleon:
    """One :class:`~chameleon_swap.Chameleon` for this rank's stages of a pipeline schedule.

    Args:
        schedule: a ``torch.distributed.pipelining`` schedule (``Schedule1F1B``,
            ``ScheduleGPipe``, :class:`ScheduleChronos`, ...) holding this rank's stages.
        budget: saved-activation bytes this rank may keep on its device at once (all its stages
            and micro-batches together): an int or a size string; None is unlimited.
        device_memory_limit: CUDA: a cap on all device memory instead (see ``Chameleon``).
        offload_weights: True: each stage's blocks (``find_blocks`` on the stage's module, else
            its child modules) keep their parameters in host memory between uses inside a step
            and come back just before their forward and their backward, the next block's
            prefetched (:class:`~chameleon_swap.parallel.weights.WeightOffload`). For stages holding more
            layers than fit; between steps every parameter is on the device as usual.
            ``last_step.weight_peak_bytes`` is the most weight bytes the rank held at once.
        **engine_kwargs: the other arguments of ``Chameleon`` (``device``, ``min_tensor_bytes``,
            ``host_memory_limit``, ...), except ``policy``: it is ``"schedule"``.
    """

    def __init__(self, schedule, budget=None, *, device_memory_limit=None,
                 offload_weights: bool = False, **engine_kwargs):
        if "policy" in engine_kwargs:
            raise ValueError("PipelineChameleon runs the 'schedule' policy; do not pass policy=")
        if not isinstance(offload_weights, bool):
            raise TypeError(f"offload_weights must be True or False; got "
                            f"{type(offload_weights).__name__} {offload_weights!r}")
        _schedule_stages(schedule)          # a clear error before any engine is made
        self.engine = Chameleon(budget, device_memory_limit=device_memory_limit,
                                policy="schedule", **engine_kwargs)
        self._policy = self.engine.policy_object
        self.offload_weights = offload_weights
        self._weight_copy = None            # one copy engine for every stage's weights
        # Per stage module (by id; each WeightOffload holds its module, so an id cannot be
        # reused while it is here): kept across attach() of new schedules over the same
        # modules, so host buffers are pinned once.
        self.weight_offloads: dict = {}
        self._wrapped: list = []
        self._in_step = False
        self._t0 = 0.0
        # The last step's actions on this rank: (seconds since the step began, "1F0"-style
        # action, saved-activation bytes resident after it), for plots of memory over time.
        self.timeline: list[tuple[float, str, int]] = []
        self.attach(schedule)

    # ------------------------------------------------------------------ wiring
    def attach(self, schedule) -> None:
        """Follow ``schedule`` (this rank's stages and order) from the next step on."""
        if self._in_step:
            raise RuntimeError("attach() a new schedule between steps, not inside eng.step()")
        stages = _schedule_stages(schedule)
        if self.offload_weights:
            _check_full_backwards(schedule, stages)
        self._unwrap()
        self.stages = stages
        self._policy.positions = schedule_positions(schedule)
        if self.offload_weights:
            self._offload_stage_weights()
        for stage in self.stages:
            fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk
            stage.forward_one_chunk = functools.partial(self._run, stage.stage_index, fwd)
            stage.backward_one_chunk = functools.partial(self._run, stage.stage_index, bwd)
            self._wrapped.append((stage, fwd, bwd))

    def _run(self, stage_index: int, fn, chunk_id: int, *args, **kwargs):
        # Saves made from here until the next action belong to (stage, micro-batch): the last
        # stage's loss is computed after forward_one_chunk returns and is tagged with it too.
        self._policy.current = (stage_index, chunk_id)
        out = fn(chunk_id, *args, **kwargs)
        if self._in_step:
            kind = "B" if fn.__name__ == "backward_one_chunk" else "F"
            if kind == "B" and self.offload_weights:
                # The stage's first block is released by nothing else once its backward is done.
                self._stage_offload(stage_index).release_idle()
            self.timeline.append((time.perf_counter() - self._t0,
                                  f"{stage_index}{kind}{chunk_id}", self.engine.resident_bytes))
            # Copies back for the coming backwards start now, while this rank sends, receives or
            # waits for the next stage.
            self._policy.prefetch()
        return out

    def detach(self) -> None:
        """Stop following the schedule (its stages run unwrapped) until the next ``attach``."""
        if self._in_step:
            raise RuntimeError("detach() between steps, not inside eng.step()")
        self._unwrap()

    def _unwrap(self) -> None:
        for stage, fwd, bwd in self._wrapped:
            stage.forward_one_chunk, stage.backward_one_chunk = fwd, bwd
        self._wrapped = []

    def _offload_stage_weights(self) -> None:
        from ..copy import make_copy_engine
        from .weights import WeightOffload
        if self._weight_copy is None:
            self._weight_copy = make_copy_engine(self.engine.device)
        keep = {}
        for stage in self.stages:
            mod = stage.submod
            off = self.weight_offloads.pop(id(mod), None)
            if off is None:
                off = WeightOffload(_stage_blocks(mod), device=self.engine.device,
                                    copy=self._weight_copy, model=mod)
            keep[id(mod)] = off
        for off in self.weight_offloads.values():     # stages no longer followed
            off.close()
        self.weight_offloads = keep

    def _stage_offload(self, stage_index: int):
        for stage in self.stages:
            if stage.stage_index == stage_index:
                return self.weight_offloads[id(stage.submod)]
        raise KeyError(stage_index)

    # ------------------------------------------------------------------ the user's view
    @contextlib.contextmanager
    def step(self) -> Iterator["PipelineChameleon"]:
        """One schedule step on this rank: every micro-batch's forward and backward."""
        offloads = list(self.weight_offloads.values())
        try:
            with self.engine.step():
                self._in_step = True
                self.timeline = []
                self._t0 = time.perf_counter()
                failed = False
                try:
                    for off in offloads:
                        off.begin_step()
                    yield self
                except BaseException:
                    failed = True
                    raise
                finally:
                    self._in_step = False
                    # Every parameter back on the device before the step ends (and the
                    # optimizer runs), whatever happened inside.
                    for off in offloads:
                        off.end_step(failed)
        finally:
            last = self.engine.last_step
            if offloads and last is not None:
                # Each stage's peak, summed: exact with one stage per rank, an upper bound
                # with two (their blocks are seldom all resident at once).
                last.weight_peak_bytes = sum(off.last_step.peak_bytes for off in offloads
                                             if off.last_step is not None)

    @property
    def last_step(self):
        return self.engine.last_step

    @property
    def history(self) -> list:
        return self.engine.history

    def close(self) -> None:
        self._unwrap()
        for off in self.weight_offloads.values():
            off.close()
        self.weight_offloads = {}
        if self._weight_copy is not None:
            self._weight_copy.close()
            self._weight_copy = None
        self.engine.close()

    def __enter__(self) -> "PipelineChameleon":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"PipelineChameleon(stages={[s.stage_index for s in self.stages]}, "
                f"engine={self.engine!r})")


__all__ = ["PipelineChameleon", "ScheduleChronos", "chronos_stage_indices", "schedule_positions"]

"""Training that survives a lost rank, on PyTorch's own machinery: ``torchrun`` (torch
elastic) for membership and restarts, ``torch.distributed.checkpoint`` (DCP) for state.

A run under ``torchrun --nnodes MIN:MAX --max-restarts K`` restarts every worker when one is
lost; the survivors re-rendezvous and each worker starts again from the newest *complete*
checkpoint, resharded by DCP to the new world size. Four pieces:

* ``Checkpoints``: ``save`` writes a step's state with DCP into ``step-N.tmp`` and, once every
  rank has written, rank 0 renames it to ``step-N`` (an atomic ``os.rename`` on one file
  system): a checkpoint half written when a failure hits keeps its ``.tmp`` name and is never
  loaded; ``latest`` sees only renamed ones. With ``blocking=False`` the state is copied and
  written on a background thread (DCP's ``async_save``, on a gloo group of its own so that its
  collectives never interleave with the training's) while training goes on; ``commit`` (called
  by the next ``save``, or by the caller, say after the next step) waits for the write on every
  rank and only then renames. Where ``async_save`` is missing (a guard: every torch >= 2.5 the
  project supports has it) the save is synchronous, and still renamed at ``commit``.
* ``GlobalBatches``: the data order as a function of the step alone: step ``s`` takes samples
  ``perm[s*B:(s+1)*B]`` of a seeded permutation (a new one each epoch), ``B`` the global batch,
  split over the ranks as ``ids[rank::world]``. A restart at step ``s`` takes exactly the
  samples the lost attempt would have: nothing skipped or repeated, the global batch kept
  whatever the world size.
* ``engine_for``: the engine of this rank from the planner's answer for this world (a dict:
  ``chameleon_swap.sim.restart.RestartPlan.as_dict()``, asked at each start): a ``Chameleon``
  with the per-rank activation budget, given the model when the plan recomputes.
* ``reduce_gradients``: the gradient of the global batch's mean loss: each rank backpropagates
  the *sum* of its samples' losses, gradients are summed over ranks and divided by ``B``, so
  the step is the same function of the batch at any world size (up to the order of the sums).

What a different world size changes: the order in which per-sample sums are added (per rank,
then across ranks), so losses after a recovery at a new world size differ from the original
layout's in the last bits; with the same final layout they are equal bit for bit.

May import: torch, ``engine.py`` (``engine_for`` builds a ``Chameleon``); the plan comes in
as plain data, so nothing of ``sim/``.
Imported by: the public re-export ``chameleon_swap.elastic``.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist

_STEP = re.compile(r"^step-(\d+)$")


class Checkpoints:
    """DCP checkpoints under ``root``, one folder per step, only complete ones visible."""

    def __init__(self, root: Union[str, os.PathLike]):
        self.root = Path(root)
        self._pending: Optional[tuple] = None     # (step, future, on_written) of an async save
        self._group = None                        # the async saves' gloo group

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir()
                      if (m := _STEP.match(p.name)) and p.is_dir())

    def latest(self) -> Optional[int]:
        """The newest complete checkpoint's step, or None."""
        s = self.steps()
        return s[-1] if s else None

    def incomplete(self) -> list[int]:
        """Steps whose checkpoint was begun but never committed (``step-N.tmp``): never
        loaded; the next save of that step replaces it."""
        if not self.root.is_dir():
            return []
        return sorted(int(p.name[5:-4]) for p in self.root.iterdir()
                      if p.name.startswith("step-") and p.name.endswith(".tmp")
                      and p.name[5:-4].isdigit())

    @property
    def pending(self) -> Optional[int]:
        """The step of a save written in the background and not yet committed, or None."""
        return None if self._pending is None else self._pending[0]

    def save(self, state: dict, step: int,
             on_written: Optional[Callable[[], None]] = None, blocking: bool = True) -> Path:
        """Write ``state`` (a DCP state dict) as step ``step``; every rank calls it.
        ``on_written`` runs on every rank after its shard is written and before the rename.

        ``blocking=False``: copy the state and write it in the background (``async_save``
        where this torch has it); the checkpoint becomes visible at ``commit``, which the next
        ``save`` calls first. Returns the path the checkpoint has once committed."""
        import torch.distributed.checkpoint as dcp
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int; got {step!r}")
        if not isinstance(blocking, bool):
            raise TypeError(f"blocking must be True or False; got {blocking!r}")
        self.commit()
        tmp = self._tmp(step)
        if _rank() == 0:
            if tmp.exists():                    # a previous attempt's half-written copy
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        _barrier()
        if blocking or not hasattr(dcp, "async_save"):
            dcp.save(state, checkpoint_id=str(tmp))
            self._pending = (step, None, on_written)
        else:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._pg())
            # Newer torch may answer with an AsyncSaveResponse (staging and upload futures).
            future = getattr(future, "upload_completion", future)
            self._pending = (step, future, on_written)
        if blocking:
            self.commit()
        return self.path(step)

    def commit(self) -> Optional[int]:
        """Finish the pending save: wait for this rank's write, run its ``on_written``, wait
        for every rank, then rename (rank 0). Every rank calls it; returns the step made
        visible, or None when nothing was pending."""
        if self._pending is None:
            return None
        step, future, on_written = self._pending
        self._pending = None
        if future is not None:
            future.result()                     # raises what the background write raised
        if on_written is not None:
            on_written()
        _barrier()                              # every rank's shard is written
        final = self.path(step)
        if _rank() == 0:
            if final.exists():
                shutil.rmtree(final)
            os.rename(self._tmp(step), final)   # the completion marker: atomic on one fs
        _barrier()
        return step

    def close(self) -> None:
        """Commit what is pending and free the async saves' group."""
        self.commit()
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None

    def _tmp(self, step: int) -> Path:
        return self.root / f"step-{step}.tmp"

    def _pg(self):
        """A gloo group of all ranks for the background writes' collectives: on the default
        group they could pair with the training's own collectives of another thread."""
        if not dist.is_initialized():
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def load(self, state: dict, step: Optional[int] = None) -> Optional[int]:
        """Load the checkpoint of ``step`` (default the newest complete one) into ``state`` in
        place, resharded to this world; returns its step, or None when there is none."""
        import torch.distributed.checkpoint as dcp
        step = self.latest() if step is None else step
        if step is None:
            return None
        if not self.path(step).is_dir():
            raise ValueError(f"step: no complete checkpoint of step {step} under {self.root}")
        dcp.load(state, checkpoint_id=str(self.path(step)))
        return step


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class GlobalBatches:
    """The global batch of every step, from the step alone (see the module docstring)."""

    def __init__(self, num_samples: int, global_batch: int, seed: int = 0):
        for k, v in (("num_samples", num_samples), ("global_batch", global_batch)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{k} must be a positive int; got {v!r}")
        if global_batch > num_samples:
            raise ValueError(f"global_batch ({global_batch}) must not exceed num_samples "
                             f"({num_samples})")
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self.per_epoch = num_samples // global_batch

    def batch(self, step: int) -> list[int]:
        """Sample ids of step ``step`` (0-based), the whole global batch."""
        epoch, k = divmod(step, self.per_epoch)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(self.num_samples, generator=g)
        return perm[k * self.global_batch:(k + 1) * self.global_batch].tolist()

    def shard(self, step: int, rank: int, world: int) -> list[int]:
        """This rank's samples of step ``step``."""
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank must be in 0..world-1; got rank {rank}, world {world}")
        if world > self.global_batch:
            raise ValueError(f"world ({world}) must not exceed global_batch "
                             f"({self.global_batch}): a rank would get no sample")
        return self.batch(step)[rank::world]


def reduce_gradients(params, global_batch: int) -> None:
    """Sum ``params``' gradients over the ranks and divide by ``global_batch`` (each rank's
    backward was of the sum of its samples' losses)."""
    for p in params:
        if p.grad is None:
            continue
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad.div_(global_batch)


def global_loss(local_sum: torch.Tensor, global_batch: int) -> torch.Tensor:
    """The global batch's mean loss from each rank's sum (summed over the ranks)."""
    t = local_sum.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / global_batch


def restart_count() -> int:
    """How many times torchrun restarted this node's workers after a worker failed
    (``TORCHELASTIC_RESTART_COUNT``; 0 on the first attempt). A group torchrun re-forms because
    another node left or joined keeps the count as it was, so it does not number the starts
    (``examples/elastic_train.py`` counts those itself)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def engine_for(plan: Mapping, model: Optional[torch.nn.Module] = None, **engine_kwargs):
    """This rank's ``Chameleon`` from the planner's answer for this world: ``plan`` is plain
    data with ``world``, ``dp``, ``pp``, ``tp``, ``budget_bytes`` and ``recompute`` (as
    ``chameleon_swap.sim.restart.RestartPlan.as_dict()`` gives). The engine holds
    ``budget_bytes`` of activations; with ``recompute`` it is given ``model`` so that it may
    recompute blocks. ``engine_kwargs`` go to ``Chameleon`` as they are (``device=``...)."""
    from ..engine import Chameleon
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must be a mapping (RestartPlan.as_dict()); got "
                        f"{type(plan).__name__}")
    missing = [k for k in ("world", "dp", "pp", "tp", "budget_bytes", "recompute")
               if k not in plan]
    if missing:
        raise ValueError(f"plan lacks {', '.join(missing)}; give RestartPlan.as_dict()")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if plan["world"] != world:
        raise ValueError(f"plan is for a world of {plan['world']} ranks; this one has {world}: "
                         f"ask the planner again with the world size torchrun gives")
    if (plan["dp"], plan["pp"], plan["tp"]) != (world, 1, 1):
        raise ValueError(f"plan: this runtime runs data parallel only (dp = world = {world}, "
                         f"pp = tp = 1); got dp {plan['dp']}, pp {plan['pp']}, tp {plan['tp']}")
    if plan["recompute"] and model is None:
        raise ValueError("plan recomputes blocks: pass model= (the model being trained)")
    return Chameleon(budget=plan["budget_bytes"], model=model if plan["recompute"] else None,
                     **engine_kwargs)

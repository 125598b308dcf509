"""Training that survives a lost rank, on PyTorch's own machinery: ``torchrun`` (torch
elastic) for membership and restarts, ``torch.distributed.checkpoint`` (DCP) for state.

A run under ``torchrun --nnodes MIN:MAX --max-restarts K`` restarts every worker when one is
lost; the survivors re-rendezvous and each worker starts again from the newest *complete*
checkpoint, resharded by DCP to the new world size. Three pieces:

* ``Checkpoints``: ``save`` writes a step's state with DCP into ``step-N.tmp`` and, once every
  rank has written, rank 0 renames it to ``step-N`` (an atomic ``os.rename`` on one file
  system): a checkpoint half written when a failure hits keeps its ``.tmp`` name and is never
  loaded; ``latest`` sees only renamed ones.
* ``GlobalBatches``: the data order as a function of the step alone: step ``s`` takes samples
  ``perm[s*B:(s+1)*B]`` of a seeded permutation (a new one each epoch), ``B`` the global batch,
  split over the ranks as ``ids[rank::world]``. A restart at step ``s`` takes exactly the
  samples the lost attempt would have: nothing skipped or repeated, the global batch kept
  whatever the world size.
* ``reduce_gradients``: the gradient of the global batch's mean loss: each rank backpropagates
  the *sum* of its samples' losses, gradients are summed over ranks and divided by ``B``, so
  the step is the same function of the batch at any world size (up to the order of the sums).

What a different world size changes: the order in which per-sample sums are added (per rank,
then across ranks), so losses after a recovery at a new world size differ from the original
layout's in the last bits; with the same final layout they are equal bit for bit.

May import: torch only (nothing else of the package).
Imported by: the public re-export ``chameleon_swap.elastic``.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

_STEP = re.compile(r"^step-(\d+)$")


class Checkpoints:
    """DCP checkpoints under ``root``, one folder per step, only complete ones visible."""

    def __init__(self, root: Union[str, os.PathLike]):
        self.root = Path(root)

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

    def save(self, state: dict, step: int,
             on_written: Optional[Callable[[], None]] = None) -> Path:
        """Write ``state`` (a DCP state dict) as step ``step``; every rank calls it.
        ``on_written`` runs on every rank after its shard is written and before the rename."""
        import torch.distributed.checkpoint as dcp
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int; got {step!r}")
        tmp = self.root / f"step-{step}.tmp"
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:
            if tmp.exists():                    # a previous attempt's half-written copy
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        _barrier()
        dcp.save(state, checkpoint_id=str(tmp))
        if on_written is not None:
            on_written()
        _barrier()
        final = self.path(step)
        if rank == 0:
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)               # the completion marker: atomic on one fs
        _barrier()
        return final

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
    """How many times torchrun has restarted the workers (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

"""Train under torchrun with an elastic range of nodes; survive a lost agent.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 2:3 --nproc-per-node 1 --max-restarts 3 --rdzv-backend c10d \
        --rdzv-endpoint localhost:29400 examples/elastic_train.py --ckpt /tmp/ckpt --records /tmp/log

Every worker starts from the newest complete DCP checkpoint (resharded to the world it finds),
takes its share of each step's global batch from ``GlobalBatches`` (the order depends on the
step alone) and checkpoints every ``--every`` steps. When an agent is lost, torchrun restarts the
survivors' workers, they re-rendezvous and continue: no sample skipped or repeated, the global
batch kept. Each rank appends the sample ids of every step to ``--records``/samples.jsonl, rank 0
the step's loss (as ``float.hex``) to ``--records``/losses.jsonl, with the attempt and world size.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives every rendezvous round a store of its own: with
the agents' shared store, the restarted workers' gloo mesh was seen to look up a killed worker's
stale address and fail to connect (torch 2.13, localhost).

Fault injection for the tests: ``CS_ELASTIC_KILL=STEP:PHASE:AGENT`` (PHASE one of forward,
backward, optimizer, save) kills the process group of the agent whose ``CS_AGENT`` is AGENT, on
the first attempt, at that point of that step.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from chameleon_swap.elastic import (Checkpoints, GlobalBatches, global_loss, reduce_gradients,
                                    restart_count)


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(8, generator=g)
    return x, x.sum().sin().reshape(1)


def make_model(width: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 1))


def killer(step: int, phase: str):
    """A function that kills this agent's process group at (step, phase) when asked to."""
    spec = os.environ.get("CS_ELASTIC_KILL")
    if not spec or restart_count() != 0:
        return lambda s, p: None
    k_step, k_phase, k_agent = spec.split(":")
    if k_agent != os.environ.get("CS_AGENT"):
        return lambda s, p: None

    def maybe(s: int, p: str) -> None:
        if s == int(k_step) and p == k_phase:
            # The whole "node": the agent's process group, then this worker's (torchrun starts
            # workers in a session of their own).
            os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
            os.killpg(os.getpgrp(), signal.SIGKILL)
    return maybe


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint folder")
    ap.add_argument("--records", required=True, help="folder for samples.jsonl and losses.jsonl")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--every", type=int, default=2, help="checkpoint every N steps")
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--width", type=int, default=16, help="hidden width of the small MLP")
    args = ap.parse_args(argv)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = restart_count()
    model = make_model(args.width)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ckpts = Checkpoints(args.ckpt)
    data = GlobalBatches(args.samples, args.global_batch, seed=1)
    kill = killer(0, "")

    # Step 0's state is a checkpoint too, so that a failure before the first save loses nothing.
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": torch.tensor(0)}
    if ckpts.latest() is None:
        ckpts.save(state, 0)
    ckpts.load(state)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    start = int(state["step"])
    log = Path(args.records)
    log.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        print(f"attempt {attempt}: world {world}, resuming after step {start}", flush=True)

    step_box = [0]
    model[0].register_forward_pre_hook(lambda m, a: kill(step_box[0], "forward"))
    model[0].weight.register_hook(lambda g: kill(step_box[0], "backward"))
    opt.register_step_pre_hook(lambda o, a, k: kill(step_box[0], "optimizer"))

    for step in range(start + 1, args.steps + 1):
        step_box[0] = step
        ids = data.shard(step - 1, rank, world)
        xs, ys = zip(*(sample(i) for i in ids))
        out = model(torch.stack(xs))
        local = torch.nn.functional.mse_loss(out, torch.stack(ys), reduction="sum")
        opt.zero_grad(set_to_none=True)
        local.backward()
        reduce_gradients(model.parameters(), args.global_batch)
        opt.step()
        loss = global_loss(local, args.global_batch)
        with open(log / "samples.jsonl", "a") as f:
            f.write(json.dumps({"attempt": attempt, "world": world, "rank": rank, "step": step,
                                "ids": ids}) + "\n")
        if rank == 0:
            with open(log / "losses.jsonl", "a") as f:
                f.write(json.dumps({"attempt": attempt, "world": world, "step": step,
                                    "loss": float(loss).hex(), "time": time.time()}) + "\n")
        if step % args.every == 0:
            msd, osd = get_state_dict(model, opt)
            ckpts.save({"model": msd, "optim": osd, "step": torch.tensor(step)}, step,
                       on_written=lambda: kill(step, "save"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

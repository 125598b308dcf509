"""Train under torchrun with an elastic range of nodes; survive a lost agent.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 2:3 --nproc-per-node 1 --max-restarts 3 --rdzv-backend c10d \
        --rdzv-endpoint localhost:29400 examples/elastic_train.py --ckpt /tmp/ckpt --records /tmp/log \
        --device-memory 5500000

Every worker starts from the newest complete DCP checkpoint (resharded to the world it finds),
asks the recovery planner (``chameleon_swap.sim.restart.plan_restart``) for the layout and the
per-rank activation budget of this world, applies them (``chameleon_swap.elastic.engine_for``:
a ``Chameleon`` holding that budget, recomputing blocks where the plan says so), takes its share
of each step's global batch from ``GlobalBatches`` (the order depends on the step alone) and
checkpoints every ``--every`` steps, in the background (DCP ``async_save``): a checkpoint is
committed (made loadable) at the end of the next step, once every rank's write is done. When an
agent is lost, torchrun restarts the survivors' workers; they re-rendezvous, ask the planner
again for the smaller world (each rank now takes more of the global batch, so more activations)
and continue: no sample skipped or repeated, the global batch kept.

The model is a small Llama (``--layers``, ``--dim``, ``--seq``); the planner is given its shape
and ``--hardware``, whose memory ``--device-memory`` replaces (on the CPU, a device of that size:
with 5500000 bytes, 3 ranks keep everything and 2 or 1 must swap and recompute).

Records under ``--records``: ``plans.jsonl`` (rank 0, one line per start: its number, the
restart count, world, the checkpoint it resumed from, the half-written ones it ignored, the
planner's answer),
``samples.jsonl`` (each rank, the sample ids of every step), ``losses.jsonl`` (rank 0, the
step's loss as ``float.hex``, with the budget and mode in force and what the engine moved). Every
record says which start of the worker group wrote it (``start``, from 0; see ``start_number``).

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives every rendezvous round a store of its own: with
the agents' shared store, the restarted workers' gloo mesh was seen to look up a killed worker's
stale address and fail to connect (torch 2.13, localhost).

Fault injection for the tests: ``CS_ELASTIC_KILL=STEP:PHASE:AGENT`` (PHASE one of forward,
backward, optimizer, save) kills the process group of the agent whose ``CS_AGENT`` is AGENT, on
the first start, at that point of that step (``save``: after this rank's shard of step STEP's
checkpoint is written, before the rename that makes it loadable).
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

from chameleon_swap.elastic import (Checkpoints, GlobalBatches, engine_for, global_loss,
                                    reduce_gradients, restart_count)
from chameleon_swap.sim.hardware import load as load_hardware
from chameleon_swap.sim.models import ModelConfig
from chameleon_swap.sim.restart import plan_restart
from chameleon_swap.workloads.llama import Llama, LlamaConfig

VOCAB = 256


def sample(i: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``i``: tokens and next-token targets, from ``i`` alone."""
    g = torch.Generator().manual_seed(i)
    t = torch.randint(VOCAB, (seq + 1,), generator=g)
    return t[:-1], t[1:]


def make_model(args) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=VOCAB, dim=args.dim, n_layers=args.layers, n_heads=4,
                             n_kv_heads=2, max_seq_len=args.seq))


def planner_model(model: Llama, args) -> ModelConfig:
    """The model's shape as the simulator describes it (fp32, SGD with momentum: weights,
    gradients and momentum, 12 bytes per parameter)."""
    c = model.config
    return ModelConfig(layers=c.n_layers, hidden=c.dim, heads=c.n_heads, kv_heads=c.n_kv_heads,
                       ffn=c.ffn_dim, vocab=c.vocab_size, seq=args.seq, dtype="fp32",
                       state_bytes_per_param=12, name="elastic-llama")


def killer(start: int):
    """A function that kills this agent's process group at (step, phase) when asked to, on the
    worker group's first start only."""
    spec = os.environ.get("CS_ELASTIC_KILL")
    if not spec or start != 0:
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


def start_number(log: Path, rank: int) -> int:
    """Which start of the worker group this is, from 0: each start appends one line to
    ``plans.jsonl``; rank 0 counts them and tells the others. ``restart_count()``
    (``TORCHELASTIC_RESTART_COUNT``) counts only the restarts after this node's own worker
    failed: when torchrun re-forms the group because another node left, the survivors' count
    stays as it was (torch 2.13: after a node was killed in step 4, the survivors resumed on 2
    ranks from step 2 at restart count 0; seen in three of the project's test runs)."""
    n = [0]
    if rank == 0:
        plans = log / "plans.jsonl"
        n[0] = len(plans.read_text().splitlines()) if plans.exists() else 0
    dist.broadcast_object_list(n, src=0)
    return int(n[0])


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint folder")
    ap.add_argument("--records", required=True,
                    help="folder for plans.jsonl, samples.jsonl and losses.jsonl")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--every", type=int, default=2, help="checkpoint every N steps")
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--layers", type=int, default=4, help="blocks of the small Llama")
    ap.add_argument("--dim", type=int, default=64, help="hidden size of the small Llama")
    ap.add_argument("--seq", type=int, default=32, help="tokens per sample")
    ap.add_argument("--hardware", default="h100-sxm", help="the planner's device profile")
    ap.add_argument("--device-memory", type=int, default=None, metavar="BYTES",
                    help="device memory per rank the planner assumes instead of the profile's")
    ap.add_argument("--sync-save", action="store_true",
                    help="write checkpoints synchronously (default: in the background)")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = restart_count()
    model = make_model(args)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ckpts = Checkpoints(args.ckpt)
    data = GlobalBatches(args.samples, args.global_batch, seed=1)

    # Step 0's state is a checkpoint too, so that a failure before the first save loses nothing.
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": torch.tensor(0)}
    ignored = ckpts.incomplete()       # half written when a failure hit: never loaded
    if ckpts.latest() is None:
        ckpts.save(state, 0)
    ckpts.load(state)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    start = int(state["step"])

    # The planner's answer for this world, applied: this rank's engine and its budget.
    plan = plan_restart(planner_model(model, args), load_hardware(args.hardware), world,
                        args.global_batch, args.device_memory).as_dict()
    eng = engine_for(plan, model, device="cpu")
    log = Path(args.records)
    log.mkdir(parents=True, exist_ok=True)
    n = start_number(log, rank)
    if rank == 0:
        with open(log / "plans.jsonl", "a") as f:
            f.write(json.dumps({"start": n, "attempt": attempt, "world": world,
                                "resumed_from": start, "ignored_incomplete": ignored,
                                "plan": plan, "engine_budget_bytes": eng.budget_bytes}) + "\n")
        print(f"start {n} (restart count {attempt}): world {world}, resuming after step "
              f"{start}; planner: dp {plan['dp']}, {plan['mode']}, budget "
              f"{plan['budget_bytes']} bytes per rank ({plan['samples_per_rank']} samples)",
              flush=True)

    kill = killer(n)
    step_box = [0]
    model.layers[0].register_forward_pre_hook(lambda m, a: kill(step_box[0], "forward"))
    model.tok_emb.weight.register_hook(lambda g: kill(step_box[0], "backward"))
    opt.register_step_pre_hook(lambda o, a, k: kill(step_box[0], "optimizer"))

    for step in range(start + 1, args.steps + 1):
        step_box[0] = step
        ids = data.shard(step - 1, rank, world)
        xs, ys = zip(*(sample(i, args.seq) for i in ids))
        opt.zero_grad(set_to_none=True)
        with eng.step():
            logits = model(torch.stack(xs))
            local = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), torch.stack(ys).reshape(-1),
                reduction="sum")
            local.backward()
        reduce_gradients(model.parameters(), args.global_batch)
        opt.step()
        loss = global_loss(local, args.global_batch)
        # The previous checkpoint, written in the background during this step, made loadable.
        ckpts.commit()
        stats = eng.last_step
        with open(log / "samples.jsonl", "a") as f:
            f.write(json.dumps({"start": n, "attempt": attempt, "world": world, "rank": rank,
                                "step": step, "ids": ids}) + "\n")
        if rank == 0:
            with open(log / "losses.jsonl", "a") as f:
                f.write(json.dumps({
                    "start": n, "attempt": attempt, "world": world, "step": step,
                    "loss": float(loss).hex(), "time": time.time(), "mode": plan["mode"],
                    "budget_bytes": stats.budget_bytes,
                    "peak_resident_bytes": stats.peak_resident_bytes,
                    "offloaded_bytes": stats.offloaded_bytes,
                    "recomputed_bytes": stats.recomputed_bytes}) + "\n")
        if step % args.every == 0:
            msd, osd = get_state_dict(model, opt)
            ckpts.save({"model": msd, "optim": osd, "step": torch.tensor(step)}, step,
                       on_written=lambda s=step: kill(s, "save"), blocking=args.sync_save)
    ckpts.close()
    eng.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

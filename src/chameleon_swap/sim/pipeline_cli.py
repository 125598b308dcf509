"""``simulate --pp N --micro-batches M --schedule 1f1b|interleaved|chronos``: one pipeline step
per memory mode (everything kept, full recompute, the schedule-aware engine, the engine with
recomputation where the link cannot keep up), per rank: model states, activation peak, total
against the device, bytes moved, share of blocks recomputed, stall; step time and bubble."""
from __future__ import annotations

import argparse
import json

from ..config import format_bytes
from ..parallel.schedules import SCHEDULES
from . import report
from .pipeline import MODES, simulate_pipeline


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline-parallel ranks; above 1 simulates a pipeline step (default 1)")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches per pipeline step (default 4 x --pp)")
    p.add_argument("--schedule", default=None, choices=SCHEDULES,
                   help="pipeline schedule (default 1f1b; implies a pipeline step)")


def wanted(args: argparse.Namespace) -> bool:
    return args.pp > 1 or args.schedule is not None


def run(args: argparse.Namespace, cfg, hw, budget) -> dict:
    """Simulate and print; returns the results by mode."""
    if args.trace or args.hf:
        raise ValueError("--pp/--schedule simulate a --model (formula) pipeline; a recorded or "
                         "traced step cannot be cut into stages")
    if args.pp < 1:
        raise ValueError(f"--pp must be a positive int; got {args.pp}")
    m = args.micro_batches if args.micro_batches is not None else 4 * args.pp
    schedule = args.schedule or "1f1b"
    results = {mode: simulate_pipeline(cfg, hw, args.pp, m, schedule, mode, budget)
               for mode in MODES}
    if args.json:
        print(json.dumps({k: r.as_dict() for k, r in results.items()}))
        return results
    print(f"{cfg.describe()}\nhardware: {hw.name}, {format_bytes(hw.usable_bytes)} usable per "
          f"device; pipeline: {schedule}, pp={args.pp}, {m} micro-batches of "
          f"{cfg.micro_batch} x {cfg.seq} tokens\n")
    rows = []
    for mode, res in results.items():
        for r in res.ranks:
            rows.append([mode if r.rank == 0 else "", r.rank, ",".join(map(str, r.stages)),
                         report.gib(r.state_bytes), report.gib(r.activation_peak_bytes),
                         report.gib(r.total_bytes), report.gib(r.offloaded_bytes),
                         f"{r.recomputed_fraction:.0%}", r.stall_seconds, r.fits,
                         res.step_seconds if r.rank == 0 else None,
                         f"{res.bubble_fraction:.1%}" if r.rank == 0 else None])
    print(report.table(["mode", "rank", "stages", "states", "act peak", "total", "moved out",
                        "recomputed", "stall s", "fits", "step s", "bubble"], rows), end="")
    return results

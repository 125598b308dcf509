"""The ``demo`` and ``bench`` commands: argument parsing only; the work is in ``demo.py`` and
``sweep.py``. Nothing here imports torch at module level, so ``--help`` answers at once."""
from __future__ import annotations

import argparse
from pathlib import Path

DEMO_HELP = ("the main job: train a variable-length Llama and a routed MoE under a budget with "
             "and without the engine, and show what it bought")
BENCH_HELP = "sweep workloads x baselines x budgets; write results.json, results.md and plots"

# The registries' names, here without importing torch (tests check they match the registries).
WORKLOAD_NAMES = ("llama-varlen", "moe", "layerdrop", "video-dit", "mixed")
BASELINE_NAMES = ("none", "full-recompute", "selective-recompute", "save-on-cpu", "swap-all",
                  "static", "guard", "chameleon")


def configure_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("out/demo"), metavar="DIR",
                   help="where summary.json and the figures go (default: out/demo)")
    p.add_argument("--steps", type=int, default=60, help="steps per workload (default: 60)")
    p.add_argument("--size", default="small", help="workload size preset: tiny, small or gpu "
                   "(default: small)")
    p.add_argument("--device", default=None, help="'cpu' or 'cuda[:N]' (default: cuda if "
                   "available, else cpu)")


def run_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .demo import run_demo as demo
    try:
        summary = demo(args.out, steps=args.steps, size=args.size, device=args.device)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    return 0 if summary["budget_held"] and summary["losses_identical"] else 1


def configure_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", nargs="+", default=list(WORKLOAD_NAMES), metavar="W",
                   help=f"workloads: {', '.join(WORKLOAD_NAMES)}, hf:<model_type> (default: all "
                        "built-in ones)")
    p.add_argument("--baseline", nargs="+", default=list(BASELINE_NAMES), metavar="B",
                   help=f"baselines: {', '.join(BASELINE_NAMES)} (default: all)")
    p.add_argument("--budget", nargs="+", default=["30%", "60%"], metavar="X",
                   help="activation budgets: a share of each workload's natural activation peak "
                        "('30%%') or a size ('64MiB') (default: 30%% 60%%)")
    p.add_argument("--steps", type=int, default=12, help="timed steps (default: 12)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps (default: 2)")
    p.add_argument("--size", default="small", help="workload size preset: tiny, small or gpu")
    p.add_argument("--device", default=None, help="'cpu' or 'cuda[:N]'")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU compute threads (default: all cores but one, left to the copies)")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="CUDA: cap the process's device memory (e.g. 20GiB); runs that do not "
                        "fit are reported as OOM")
    p.add_argument("--no-meter", action="store_true",
                   help="skip the metered pass (CPU peaks and memory curves)")
    p.add_argument("--out", type=Path, default=Path("out/bench"), metavar="DIR",
                   help="where results.json, results.md and the figures go (default: out/bench)")


def run_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .harness import SweepConfig
    from .sweep import run_bench as bench
    try:
        cfg = SweepConfig(workloads=args.workload, baselines=args.baseline, budgets=args.budget,
                          steps=args.steps, warmup=args.warmup, size=args.size,
                          device=args.device, threads=args.threads,
                          device_memory=args.device_memory,
                          meter=False if args.no_meter else None)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    bench(cfg, args.out)
    return 0

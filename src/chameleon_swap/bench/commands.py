"""The ``demo`` and ``bench`` commands: argument parsing only; the work is in ``demo.py`` and
``sweep.py``. Nothing here imports torch at module level, so ``--help`` answers at once.

``bench --quick`` is the sweep cut to fit a GPU lent for ten minutes: one workload (llama-varlen),
three runs (the plain step, full recomputation, the engine at 30%) and the plain step's second
run (is it bitwise reproducible?), one warm-up and four timed steps. Estimated for one H100 with
``--size gpu``, from steps measured there (plain 0.4 s, recomputed 1.2x, the engine at 30% 2.5x,
but 8-15 s for the engine's first step of each new length, up to four): the natural-peak probe
and the peers about 12 s, the engine up to 65 s, five model builds (0.8B parameters drawn on the
host) about 50 s: about 2 minutes, not measured.
The full default sweep (5 workloads x 14 runs x 14 steps: 5 peers, 4 engine baselines at 2
budgets, and the plain step's second run) takes well over an hour at that size: with 11 runs, one
workload with one budget and 6 steps had done 30 of its 56 step runs after 220 s.
"""
from __future__ import annotations

import argparse
from pathlib import Path

DEMO_HELP = ("the main job: train a variable-length Llama and a routed MoE under a budget with "
             "and without the engine, and show what it bought")
BENCH_HELP = "sweep workloads x baselines x budgets; write results.json, results.md and plots"

# The registries' names, here without importing torch (tests check they match the registries).
WORKLOAD_NAMES = ("llama-varlen", "moe", "layerdrop", "video-dit", "mixed")
BASELINE_NAMES = ("none", "full-recompute", "selective-recompute", "save-on-cpu", "swap-all",
                  "static", "guard", "chameleon", "hybrid")

# Steps of the demo's comparison with gradient checkpointing (24: with three lengths, the first
# plans of each and the one made again once selective is measured fall in the first half).
CHOICE_STEPS = 24
# The demo's swapping workloads, steps each: 40 keep the whole demo within 90 s on the project's
# busy 2-core CPU (60 took 89-93 s there on 2026-11-27, 71 s of it these workloads).
DEMO_STEPS = 40

# What --quick sweeps where the command line does not say otherwise, and the full defaults.
QUICK = dict(workload=["llama-varlen"], baseline=["none", "full-recompute", "chameleon"],
             budget=["30%"], steps=4, warmup=1)
FULL = dict(workload=list(WORKLOAD_NAMES), baseline=list(BASELINE_NAMES), budget=["30%", "60%"],
            steps=12, warmup=2)


def configure_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("out/demo"), metavar="DIR",
                   help="where summary.json and the figures go (default: out/demo)")
    p.add_argument("--steps", type=int, default=DEMO_STEPS,
                   help=f"steps per workload (default: {DEMO_STEPS})")
    p.add_argument("--size", default="small", help="workload size preset: tiny, small or gpu "
                   "(default: small)")
    p.add_argument("--device", default=None, help="'cpu' or 'cuda[:N]' (default: cuda if "
                   "available, else cpu)")
    p.add_argument("--choice-steps", type=int, default=CHOICE_STEPS, metavar="N",
                   help="steps of the comparison with gradient checkpointing (a Hugging Face "
                        "Llama: no engine, gradient checkpointing, swap only, model=); 0 skips "
                        "it (default: %(default)s)")


def run_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .demo import run_demo as demo
    try:
        summary = demo(args.out, steps=args.steps, size=args.size, device=args.device,
                       choice_steps=args.choice_steps)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    choice = summary.get("choice") or {}
    choice_ok = choice.get("losses_exact", True) and all(
        r["fits_budget"] for k, r in (choice.get("legs") or {}).items()
        if k in ("swap only", "chameleon model="))
    return 0 if summary["budget_held"] and summary["losses_identical"] and choice_ok else 1


def configure_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", nargs="+", default=None, metavar="W",
                   help=f"workloads: {', '.join(WORKLOAD_NAMES)}, hf:<model_type> (default: all "
                        "built-in ones; --quick: llama-varlen)")
    p.add_argument("--baseline", nargs="+", default=None, metavar="B",
                   help=f"baselines: {', '.join(BASELINE_NAMES)} (hybrid: the engine given the "
                        "model, so it may recompute blocks) (default: all; --quick: "
                        f"{' '.join(QUICK['baseline'])})")
    p.add_argument("--budget", nargs="+", default=None, metavar="X",
                   help="activation budgets: a share of each workload's natural activation peak "
                        "('30%%') or a size ('64MiB') (default: 30%% 60%%; --quick: 30%%)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: 12; --quick: 4)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed first steps (default: 2; --quick: 1)")
    p.add_argument("--quick", action="store_true",
                   help="a sweep that fits a few minutes on one GPU even with --size gpu: the "
                        "defaults above marked --quick (options given explicitly still apply)")
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


def bench_config(args: argparse.Namespace):
    """The ``SweepConfig`` the parsed ``bench`` arguments ask for: an option left out takes its
    ``--quick`` default with ``--quick``, else the full sweep's."""
    from .harness import SweepConfig
    defaults = QUICK if args.quick else FULL
    pick = {k: defaults[k] if getattr(args, k) is None else getattr(args, k) for k in defaults}
    return SweepConfig(workloads=pick["workload"], baselines=pick["baseline"],
                       budgets=pick["budget"], steps=pick["steps"], warmup=pick["warmup"],
                       size=args.size, device=args.device, threads=args.threads,
                       device_memory=args.device_memory, meter=False if args.no_meter else None)


def run_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .sweep import run_bench as bench
    try:
        cfg = bench_config(args)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    bench(cfg, args.out)
    return 0

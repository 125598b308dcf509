"""Planner quality and cost: the planner's predicted step time against the exact optimum.

    python benchmarks/planner_gap.py [--instances 150] [--seed 0] [--big 7] [--out DIR]

Small random instances (3-5 saved tensors, random sizes, slot times and bandwidths, mostly reverse
use order, some shuffled, some tensors never used again; budgets uniform between the largest
tensor and the natural peak): the optimum is found by exhaustive search over every set of tensors
to move and every copy-back slot of each, all judged by the same timeline model
(``timeline.simulate``) the planner uses. The gap is (planner total - optimum total) / optimum
total. Then ``plan()`` is timed on random 300-tensor profiles. Writes planner_gap-cpu.json and .md
(and a histogram PNG when matplotlib is importable) to benchmarks/results/.

It runs on the host only (no torch, no device option) whatever the machine: a GPU loan is not
needed for it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from chameleon_swap.bench.env import cpu_name, git_commit  # torch-free
from chameleon_swap.planning.swaps import (DEFAULT_MAX_EVALS, DEFAULT_MAX_PASSES, DEFAULT_MIN_EVALS,
                                    DEFAULT_WORK, plan)
from chameleon_swap.planning.timeline import Plan, Profile, Span, simulate, unmoved_peak

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def random_profile(rng: random.Random, n: int) -> Profile:
    """n saves, then backward; layout of the profiler: slot n runs from the last save to the
    first use, slot n + 1 + r starts at the first use of the tensor of use rank r."""
    never = [rng.random() < 0.1 for _ in range(n)]
    used = [i for i in range(n) if not never[i]]
    if rng.random() < 0.3:
        rng.shuffle(used)
    else:
        used.reverse()                               # backward needs the last saved first
    n_slots = n + 1 + len(used)
    rank = {i: r for r, i in enumerate(used)}
    compute = tuple(rng.uniform(0.005, 0.1) for _ in range(n_slots))
    spans = tuple(Span(int(math.exp(rng.uniform(math.log(1e6), math.log(2e8)))), i,
                       n + 1 + rank[i] if i in rank else n_slots) for i in range(n))
    # Bandwidth such that a typical tensor's copy takes 0.1x to 10x a typical slot.
    typical = statistics.fmean(sp.nbytes for sp in spans) / statistics.fmean(compute)
    bw = typical * math.exp(rng.uniform(math.log(0.1), math.log(10.0)))
    return Profile(compute, n, spans, bw, bw * rng.uniform(0.7, 1.3))


def optimum(pr: Profile, budget: int) -> tuple[float, int]:
    """Least predicted total over every move set x copy-back slots; and the plans tried."""
    best, tried = float("inf"), 0
    n, n_f = len(pr.spans), pr.n_forward
    for r in range(n + 1):
        for move in itertools.combinations(range(n), r):
            choices = [range(n_f, pr.spans[j].use + 1) if pr.spans[j].use < pr.n_slots
                       else (pr.spans[j].use,) for j in move]
            for fetch in itertools.product(*choices):
                p = simulate(pr, Plan(frozenset(move), dict(zip(move, fetch))), budget)
                tried += 1
                if p.budget_ok and p.total_seconds < best:
                    best = p.total_seconds
    return best, tried


def progress(i: int, total: int, what: str, t0: float) -> None:
    if i == total or i % max(1, total // 10) == 0:
        print(f"{what}: {i}/{total} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
              flush=True)


def pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--big", type=int, default=15, help="300-span profiles to time plan() on")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    if a.instances < 1 or a.big < 1:
        ap.error("--instances and --big must be >= 1")
    rng = random.Random(a.seed)

    rows, t0 = [], time.perf_counter()
    for i in range(a.instances):
        n = rng.randint(3, 5)
        pr = random_profile(rng, n)
        nat = unmoved_peak(pr)
        budget = rng.randint(max(sp.nbytes for sp in pr.spans), nat - 1)
        t1 = time.perf_counter()
        p = plan(pr, budget)
        ms = 1e3 * (time.perf_counter() - t1)
        opt, tried = optimum(pr, budget)
        gap = (p.predicted.total_seconds - opt) / opt
        none = simulate(pr, Plan(frozenset()), budget)
        rows.append({"spans": n, "budget_fraction": budget / nat, "planner_total_s":
                     p.predicted.total_seconds, "optimum_total_s": opt, "gap": gap,
                     "moved": len(p.move), "plan_ms": ms, "plans_tried_exhaustive": tried,
                     "no_plan_gap": (none.total_seconds - opt) / opt,
                     "budget_ok": p.predicted.budget_ok})
        progress(i + 1, a.instances, "planner gap", t0)
    gaps = np.array([max(0.0, r["gap"]) for r in rows])
    base = np.array([r["no_plan_gap"] for r in rows])
    exact = float(np.mean(gaps <= 1e-9))

    big, t0 = [], time.perf_counter()
    for i in range(a.big):
        pr = random_profile(rng, 300)
        nat = unmoved_peak(pr)
        frac = rng.uniform(0.2, 0.6)
        budget = int(nat * frac)
        t1 = time.perf_counter()
        plan(pr, budget)                             # first call: also builds the profile index
        first = 1e3 * (time.perf_counter() - t1)
        times = []
        for _ in range(3):
            t1 = time.perf_counter()
            p = plan(pr, budget)
            times.append(1e3 * (time.perf_counter() - t1))
        empty = simulate(pr, Plan(frozenset()), budget)
        big.append({"budget_fraction": frac, "plan_ms": min(times), "plan_ms_runs": times,
                    "plan_ms_first_call": first,
                    "moved": len(p.move), "stall_s": p.predicted.stall_seconds,
                    "total_s": p.predicted.total_seconds,
                    "compute_s": float(sum(pr.compute)),
                    "lower_bound_s": p.predicted.swap_only_bound_seconds,
                    "no_plan_total_s": empty.total_seconds,
                    "budget_ok": p.predicted.budget_ok})
        progress(i + 1, a.big, "plan() on 300 spans", t0)
    big_ms = [b["plan_ms"] for b in big]

    results = {
        "instances": a.instances,
        "gap_median": float(np.median(gaps)), "gap_p90": float(np.percentile(gaps, 90)),
        "gap_max": float(gaps.max()), "gap_mean": float(gaps.mean()),
        # Below zero would mean the planner beat the exhaustive optimum: a bug somewhere.
        "gap_min_unclipped": float(min(r["gap"] for r in rows)),
        "fraction_exactly_optimal": exact,
        "fraction_gap_within_1pct": float(np.mean(gaps <= 0.01)),
        "fraction_gap_within_5pct": float(np.mean(gaps <= 0.05)),
        "no_plan_gap_median": float(np.median(base)), "no_plan_gap_p90":
        float(np.percentile(base, 90)), "no_plan_gap_max": float(base.max()),
        "all_budget_ok": all(r["budget_ok"] for r in rows) and all(b["budget_ok"] for b in big),
        "plan_ms_median_small": float(np.median([r["plan_ms"] for r in rows])),
        "plan_ms_median_300_spans": float(np.median(big_ms)),
        "plan_ms_max_300_spans": float(np.max(big_ms)),
        "plan_ms_median_300_spans_first_call": float(np.median([b["plan_ms_first_call"]
                                                                for b in big])),
        "big": big,
        "per_instance": rows,
    }
    commit = git_commit()
    sha, dirty = commit.removesuffix("-dirty"), commit.endswith("-dirty")
    env = {"python": sys.version.split()[0], "numpy": np.__version__, "commit": sha,
           "dirty": dirty,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu": cpu_name(),
           "cpu_count": __import__("os").cpu_count()}
    config = {"seed": a.seed, "spans_per_instance": [3, 5], "optimum": "exhaustive",
              "budget": "uniform integer in [largest span, natural peak - 1]",
              "big_instances": a.big, "big_spans": 300, "big_budget_fraction": [0.2, 0.6],
              "plan_timing": "min of 3 runs per 300-span profile after one warm-up run",
              "planner": {"max_passes": DEFAULT_MAX_PASSES,
                          "max_evals": f"{DEFAULT_WORK} // spans within "
                                       f"[{DEFAULT_MIN_EVALS}, {DEFAULT_MAX_EVALS}]"}}
    payload = {"benchmark": "planner_gap", "environment": env, "config": config,
               "results": results}
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "planner_gap-cpu.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")

    over_lb = [b["total_s"] / b["lower_bound_s"] - 1 for b in big]
    md = (f"# planner_gap\n\ncommit {env['commit']}{' (dirty)' if dirty else ''}, "
          f"{env['date']}, {env['cpu']}, Python {env['python']}.\n\n{a.instances} random instances (3-5 saved tensors); optimum by "
          "exhaustive search (every move set x every copy-back slot) on the same timeline model; "
          "gap = (planner - optimum) / optimum of the predicted step time. Target: median gap "
          "<= 5%.\n\n"
          "| plan | median gap | p90 gap | max gap | mean gap | exactly optimal | gap <= 1% | "
          "plan() ms (median) |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |\n"
          f"| planner | {pct(results['gap_median'])} | {pct(results['gap_p90'])} | "
          f"{pct(results['gap_max'])} | {pct(results['gap_mean'])} | {100 * exact:.1f}% | "
          f"{100 * results['fraction_gap_within_1pct']:.1f}% | "
          f"{results['plan_ms_median_small']:.2f} |\n"
          f"| move nothing (the guard's forced copies) | {pct(results['no_plan_gap_median'])} | "
          f"{pct(results['no_plan_gap_p90'])} | {pct(results['no_plan_gap_max'])} | "
          f"{pct(float(base.mean()))} | {100 * float(np.mean(base <= 1e-9)):.0f}% | "
          f"{100 * float(np.mean(base <= 0.01)):.0f}% | - |\n\n"
          f"plan() on {a.big} random 300-span profiles (budget 20-60% of the natural peak; min "
          "of 3 runs each):\n\n"
          "| median ms | max ms | median ms, first call | stall-free plans | predicted total over "
          "its lower bound (median, max) |\n"
          "| --- | --- | --- | --- | --- |\n"
          f"| {results['plan_ms_median_300_spans']:.1f} | {results['plan_ms_max_300_spans']:.1f} "
          f"| {results['plan_ms_median_300_spans_first_call']:.1f} | "
          f"{sum(b['stall_s'] == 0 for b in big)}/{a.big} | "
          f"{pct(statistics.median(over_lb))}, {pct(max(over_lb))} |\n")
    (a.out / "planner_gap-cpu.md").write_text(md)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.hist(100 * gaps, bins=30, color="#369", log=True)
        ax.set_xlabel("gap to the exhaustive optimum (%)")
        ax.set_ylabel("instances (log)")
        ax.set_title(f"planner vs optimum, {a.instances} instances")
        fig.tight_layout()
        fig.savefig(a.out / "planner_gap-cpu.png", dpi=110)
        plt.close(fig)
    print(md)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

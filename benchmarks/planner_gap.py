"""Planner quality and cost: the planner's predicted step time against the exact optimum.

    python benchmarks/planner_gap.py [--instances 150] [--seed 0] [--out DIR]

On small random instances (3-5 saved tensors, random slot times, sizes, bandwidths and budgets
between the largest tensor and the natural peak) the optimum is found by exhaustive search over
every set of tensors to move and every copy-back slot of each, all judged by the same timeline
model (``timeline.simulate``). The gap is (planner total - optimum total) / optimum total.
It also times ``plan()`` on random 300-tensor profiles. Writes planner_gap-cpu.json/.md (+ PNG).
"""
from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from chameleon_swap.planner import plan  # noqa: E402
from chameleon_swap.timeline import Plan, Profile, Span, natural_peak, simulate  # noqa: E402


def random_profile(rng: random.Random, n: int) -> Profile:
    n_slots = 2 * n + 1
    compute = tuple(rng.uniform(0.005, 0.1) for _ in range(n_slots))
    order = list(range(n))
    rng.shuffle(order) if rng.random() < 0.3 else order.reverse()   # mostly reverse use order
    spans = tuple(Span(rng.randint(10**6, 2 * 10**8), i, n + 1 + order[i]) for i in range(n))
    bw = rng.uniform(5e8, 2.5e10)
    return Profile(compute, n, spans, bw, bw * rng.uniform(0.8, 1.2))


def optimum(pr: Profile, budget: int) -> float:
    best = float("inf")
    n = len(pr.spans)
    for r in range(n + 1):
        for move in itertools.combinations(range(n), r):
            for fetch in itertools.product(*[range(pr.n_forward, pr.spans[j].use + 1) for j in move]):
                p = simulate(pr, Plan(frozenset(move), dict(zip(move, fetch))), budget)
                if p.budget_ok and p.total_seconds < best:
                    best = p.total_seconds
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.instances < 1:
        ap.error(f"--instances must be >= 1; got {a.instances}")
    rng = random.Random(a.seed)
    gaps, exact, plan_ms_small = [], 0, []
    with C.progress(a.instances, "planner gap") as advance:
        for _ in range(a.instances):
            pr = random_profile(rng, rng.randint(3, 5))
            nat = natural_peak(pr)
            budget = rng.randint(max(s.nbytes for s in pr.spans), nat)
            t0 = time.perf_counter()
            p = plan(pr, budget)
            plan_ms_small.append(1e3 * (time.perf_counter() - t0))
            opt = optimum(pr, budget)
            gap = (p.predicted.total_seconds - opt) / opt
            gaps.append(max(0.0, gap))
            exact += gap <= 1e-9
            advance()
    big_ms = []
    for _ in range(5):
        pr = random_profile(rng, 300)
        nat = natural_peak(pr)
        t0 = time.perf_counter()
        plan(pr, int(nat * rng.uniform(0.2, 0.6)))
        big_ms.append(1e3 * (time.perf_counter() - t0))
    q = statistics.quantiles(gaps, n=10)
    results = {"instances": a.instances, "gap_median": statistics.median(gaps), "gap_p90": q[-1],
               "gap_max": max(gaps), "gap_mean": statistics.fmean(gaps),
               "fraction_exactly_optimal": exact / a.instances,
               "plan_ms_median_small": statistics.median(plan_ms_small),
               "plan_ms_median_300_spans": statistics.median(big_ms), "gaps": gaps}
    device = torch.device("cpu")
    payload = {"benchmark": "planner_gap", "environment": C.environment(device),
               "config": {"seed": a.seed, "spans_per_instance": [3, 5], "optimum": "exhaustive"},
               "results": results}
    md = (f"# planner_gap\n\ncommit {payload['environment']['commit']}; {a.instances} random "
          "instances (3-5 saved tensors), optimum by exhaustive search on the same timeline "
          "model; target median gap <= 5%.\n\n"
          + C.markdown_table(["median gap", "p90 gap", "max gap", "exactly optimal",
                              "plan() ms (small)", "plan() ms (300 spans)"],
                             [[f"{100 * results['gap_median']:.2f}%", f"{100 * q[-1]:.2f}%",
                               f"{100 * results['gap_max']:.2f}%",
                               f"{100 * results['fraction_exactly_optimal']:.0f}%",
                               results["plan_ms_median_small"], results["plan_ms_median_300_spans"]]]))
    path = C.write_results("planner_gap", device, payload, md, a.out)
    if C.have_matplotlib():
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.hist([100 * g for g in gaps], bins=30, color="#369")
        ax.set_xlabel("gap to optimum (%)")
        ax.set_ylabel("instances")
        ax.set_title("planner vs exhaustive optimum")
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=110)
        plt.close(fig)
    print(md)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The mode search against every mix: its predicted step over the exhaustive optimum.

    python benchmarks/mode_gap.py [--instances 40] [--seed 0] [--quick] [--out DIR]

``planning.modes.plan_hybrid`` searches families of block mixes along one order of the blocks
and can then climb a block at a time from the best (``_ModeSearch.climb``, off in the engine by
default); this script measures
how far its choice is from the best mix of kept and fully recomputed blocks, each planned by
the same swap planner and judged by the same timeline model, found by trying all of them
(2^blocks mixes). Run twice in one process: climbing two steps (``search``), and with the
climb off (``families``: the engine's default, ``CLIMB_PASSES = 0``), side by side.

Instances: random decoder-like keep views (4-8 blocks of 2-4 saved spans each, saved in order
and needed in reverse, backward twice the forward, a block's copies taking 0.3-5x its forward
on the link, budgets uniform in 20-80% of the unmoved peak), and this project's own GPU traces
(``tests/fixtures/gpu-traces``: an HF Llama 4096x8 step on an H100 at 8k and 16k tokens, its
clean profile, cut into eight blocks as the planning tests cut it) at 25%, 50% and 75%.

The gap is (the planner's predicted step - the optimum's) / the optimum's. Pure (the planning
modules and the standard library; no torch): no GPU is needed for it. Writes
``benchmarks/results/mode_gap-cpu.json`` (environment, config, per instance and medians) and a
markdown table next to it.
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

import chameleon_swap.planning.modes as modes
from chameleon_swap.bench.env import cpu_name, git_commit  # torch-free
from chameleon_swap.planning.mix_view import apply_modes
from chameleon_swap.planning.swaps import plan as plan_swaps
from chameleon_swap.planning.timeline import Profile, Span, unmoved_peak

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TRACES = ("h4096-unreached-8192", "h4096-unreached-16384")
CLIMB = 2           # the climb's steps in the ``search`` row (the engine's default is off)


def random_view(rng: random.Random) -> tuple[Profile, list]:
    """A decoder-like keep view: blocks of spans saved in order and used in reverse."""
    n_blocks, per = rng.randint(4, 8), rng.randint(2, 4)
    n = n_blocks * per
    fwd = [rng.uniform(1e-3, 4e-3) for _ in range(n)]
    compute = fwd + [rng.uniform(1e-4, 1e-3)] + [2 * f for f in reversed(fwd)]
    nbytes = [int(math.exp(rng.uniform(math.log(1e6), math.log(8e6)))) for _ in range(n)]
    spans = [Span(nbytes[i], i, n + 1 + (n - 1 - i)) for i in range(n)]
    block_bytes = statistics.fmean(sum(nbytes[b * per:(b + 1) * per]) for b in range(n_blocks))
    block_fwd = statistics.fmean(sum(fwd[b * per:(b + 1) * per]) for b in range(n_blocks))
    bw = block_bytes / (block_fwd * math.exp(rng.uniform(math.log(0.3), math.log(5.0))))
    blocks = [modes.Block(b * per, (b + 1) * per, float(sum(fwd[b * per:(b + 1) * per])),
                          int(nbytes[b * per] * rng.uniform(0.1, 0.5)))
              for b in range(n_blocks)]
    return Profile(compute, n, spans, bw, bw), blocks


def trace_view(name: str) -> tuple[Profile, list]:
    sys.path.insert(0, str(ROOT / "tests"))
    from _traces import gpu_keep_view           # (the planning tests' cut of the trace)
    prof, blocks = gpu_keep_view(name)
    # Keep and full only, as the exhaustive space: no selective figures.
    return prof, [modes.Block(b.first_span, b.end_span, b.forward_seconds, b.input_bytes)
                  for b in blocks]


def optimum(prof: Profile, blocks: list, budget: int) -> tuple[float, tuple, int]:
    """The least predicted step of every mix of kept and fully recomputed blocks that fits."""
    blocks = modes.recomputable(prof, blocks, budget)
    choices = [("keep", "full") if b.eligible else ("keep",) for b in blocks]
    best, best_mix, tried = math.inf, None, 0
    for mix in itertools.product(*choices):
        p = plan_swaps(apply_modes(prof, blocks, mix), budget).predicted
        tried += 1
        if p.budget_ok and p.total_seconds < best:
            best, best_mix = p.total_seconds, mix
    return best, best_mix, tried


def searched(prof: Profile, blocks: list, budget: int, passes: int) -> tuple[float, tuple, float]:
    """The mode search's choice with ``passes`` climbing steps: (its predicted step, its mix,
    milliseconds taken)."""
    was = modes.CLIMB_PASSES
    modes.CLIMB_PASSES = passes
    try:
        t0 = time.perf_counter()
        hp = modes.plan_hybrid(prof, blocks, budget)
        ms = 1e3 * (time.perf_counter() - t0)
    finally:
        modes.CLIMB_PASSES = was
    total = hp.predicted.total_seconds if hp.predicted.budget_ok else math.inf
    return total, hp.modes, ms


def letters(mix) -> str:
    return "".join(m[0] for m in mix) if mix else "-"


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=40, help="random keep views")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="4 random views, no GPU trace (smoke)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    if a.instances < 1:
        ap.error(f"--instances must be >= 1; got {a.instances}")
    rng = random.Random(a.seed)
    cases = []
    for i in range(4 if a.quick else a.instances):
        prof, blocks = random_view(rng)
        cases.append((f"random {i}", prof, blocks,
                      int(unmoved_peak(prof) * rng.uniform(0.2, 0.8))))
    for name in () if a.quick else TRACES:
        prof, blocks = trace_view(name)
        cases += [(f"{name} {s:.0%}", prof, blocks, int(unmoved_peak(prof) * s))
                  for s in (0.25, 0.5, 0.75)]
    rows, t0 = [], time.perf_counter()
    for i, (name, prof, blocks, budget) in enumerate(cases):
        opt, opt_mix, tried = optimum(prof, blocks, budget)
        row = {"case": name, "blocks": len(blocks), "budget_fraction": budget / unmoved_peak(prof),
               "plain_s": float(sum(prof.compute)), "optimum_s": opt,
               "optimum_mix": letters(opt_mix), "mixes_tried": tried}
        for tag, passes in (("search", CLIMB), ("families", 0)):
            total, mix, ms = searched(prof, blocks, budget, passes)
            row[tag] = {"predicted_s": total, "mix": letters(mix), "plan_ms": ms,
                        "gap": total / opt - 1 if math.isfinite(opt) else None}
        rows.append(row)
        print(f"mode gap: {i + 1}/{len(cases)} ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
    fits = [r for r in rows if r["search"]["gap"] is not None]
    summary = {}
    for tag in ("search", "families"):
        gaps = [max(0.0, r[tag]["gap"]) for r in fits]
        summary[tag] = {"gap_median": statistics.median(gaps), "gap_max": max(gaps),
                        "gap_mean": statistics.fmean(gaps),
                        "within_1pct": sum(g <= 0.01 for g in gaps) / len(gaps),
                        "exactly_optimal": sum(g <= 1e-9 for g in gaps) / len(gaps),
                        "plan_ms_median": statistics.median(r[tag]["plan_ms"] for r in fits)}
    commit = git_commit()
    sha, dirty = commit.removesuffix("-dirty"), commit.endswith("-dirty")
    env = {"python": sys.version.split()[0], "commit": sha, "dirty": dirty,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu": cpu_name()}
    config = {"seed": a.seed, "instances": a.instances, "quick": a.quick,
              "climb_passes": CLIMB, "engine_climb_passes": modes.CLIMB_PASSES,
              "traces": [] if a.quick else list(TRACES),
              "optimum": "exhaustive over kept / fully recomputed blocks, each mix's swaps "
                         "planned by swaps.plan with its defaults"}
    payload = {"benchmark": "mode_gap", "environment": env, "config": config,
               "summary": summary, "per_case": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "mode_gap-cpu.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    md = [f"# mode_gap\n\ncommit {sha}{' (dirty)' if dirty else ''}, {env['date']}, "
          f"{env['cpu']}, Python {env['python']}. The mode search's predicted step over the "
          f"best mix of kept and fully recomputed blocks (every mix tried), {len(fits)} cases "
          f"where a mix fits; `families`: the same search with its climb off.\n",
          "| search | median gap | mean gap | max gap | exactly optimal | gap <= 1% | "
          "plan ms (median) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for tag in ("search", "families"):
        s = summary[tag]
        md.append(f"| {tag} | {pct(s['gap_median'])} | {pct(s['gap_mean'])} | "
                  f"{pct(s['gap_max'])} | {pct(s['exactly_optimal'])} | "
                  f"{pct(s['within_1pct'])} | {s['plan_ms_median']:.0f} |")
    md += ["", "The GPU traces (step over the plain step; mixes as k/f per block):", "",
           "| case | optimum | search | families |", "| --- | --- | --- | --- |"]
    for r in rows:
        if r["case"].startswith("random"):
            continue
        cell = (lambda s, m: f"{s / r['plain_s']:.3f}x {m}" if math.isfinite(s) else "no fit")
        md.append(f"| {r['case']} | {cell(r['optimum_s'], r['optimum_mix'])} | "
                  f"{cell(r['search']['predicted_s'], r['search']['mix'])} | "
                  f"{cell(r['families']['predicted_s'], r['families']['mix'])} |")
    text = "\n".join(md) + "\n"
    (a.out / "mode_gap-cpu.md").write_text(text)
    print(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``chameleon-swap demo``: the main job, in one screen.

Trains the variable-length Llama decoder and the routed MoE decoder for ``steps`` steps each under
one activation budget, 30% of the demo's natural activation peak (the larger of the two: one
device has to hold every step of both), with the engine (``policy="chameleon"``) and without it,
side by side on the same batches from the same weights. It shows what the engine buys and costs:
the peak kept on the device against the budget, the step time against no engine, how many times
the operator sequence changed and what served those steps (a plan made for it, a plan found in the
cache, or the guard), and whether every loss is bit-for-bit the one without the engine.

Then the choice users face (``choice.py``): a Hugging Face Llama trained four ways on the same
batches, no engine, ``gradient_checkpointing_enable()``, swap only and the engine with ``model=``
(keep, swap or recompute per block), at a quarter of its natural peak, on the CPU with an
emulated link at an H100's ratio of bytes to compute.

Writes ``DIR/summary.json``, ``DIR/demo.png`` and ``DIR/choice.png``, and
``DIR/results.json``/``results.md`` with the full records.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Optional


from ..config import format_bytes
from .commands import CHOICE_STEPS, DEMO_STEPS as DEFAULT_STEPS
from . import choice as choice_leg
from .env import environment, progress
from .harness import SweepConfig, natural_peak, run_sweep, steps_per_workload
from .report import SOURCES, markdown, plot_choice

WORKLOADS = ("llama-varlen", "moe")
FRACTION = 0.30
WARMUP = 2


def run_demo(out_dir: Path, *, steps: int = DEFAULT_STEPS, size: str = "small",
             device: Optional[str] = None, quiet: bool = False,
             choice_steps: int = CHOICE_STEPS) -> dict:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= WARMUP:
        raise ValueError(f"steps must be an int > {WARMUP} (the warm-up); got {steps!r}")
    if isinstance(choice_steps, bool) or not isinstance(choice_steps, int) or choice_steps < 0 \
            or 0 < choice_steps < 3:
        raise ValueError(f"choice_steps must be 0 (skip the comparison with gradient "
                         f"checkpointing) or an int >= 3; got {choice_steps!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cfg = SweepConfig(workloads=list(WORKLOADS), baselines=["none", "chameleon"],
                      budgets=[f"{FRACTION:.0%}"], steps=steps - WARMUP, warmup=WARMUP, size=size,
                      device=device, meter=False)
    dev = cfg.torch_device
    # One budget for the run: a share of the larger natural peak (the device holds both).
    naturals = {w.name: natural_peak(w, w.batches(steps, dev, seed=cfg.seed), dev, cfg.seed)
                for w in cfg.resolved}
    budget = int(FRACTION * max(naturals.values()))
    cfg = dataclasses.replace(cfg, budgets=[budget])
    env = environment(dev)
    with progress(steps_per_workload(cfg) * len(cfg.resolved), "demo") as advance:
        records = run_sweep(cfg, env, progress=advance, natural_peaks=naturals)
    summary = summarize(records, budget, naturals, env, cfg)
    t1 = time.perf_counter()
    why = choice_leg.available() if choice_steps else "skipped (choice_steps=0)"
    if why is None:
        with progress(len(choice_leg.LEGS) * choice_steps,
                      "keep / swap / recompute vs gradient checkpointing") as advance:
            summary["choice"] = choice_leg.run_choice(dev, choice_steps, advance,
                                                      tiny=size == "tiny")
        plot_choice(summary["choice"], out_dir / "choice.png")
    else:
        summary["choice"] = {"skipped": why}
    # Wall time (seconds), whole and by part: the README states what the demo takes.
    t2 = time.perf_counter()
    summary["wall_seconds"] = {"total": t2 - t0, "swapping": t1 - t0, "choice": t2 - t1}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out_dir / "results.json").write_text(json.dumps(records, indent=1) + "\n")
    (out_dir / "results.md").write_text(markdown(records))
    figure = plot_demo(summary, out_dir / "demo.png")
    if not quiet:
        print(screen(summary, figure, out_dir))
    return summary


def summarize(records: list[dict], budget: int, naturals: dict, env: dict,
              cfg: SweepConfig) -> dict:
    per_workload, steps = {}, []
    for name in WORKLOADS:
        none = next(r for r in records if r["workload"] == name and r["baseline"] == "none")
        cham = next(r for r in records if r["workload"] == name and r["baseline"] == "chameleon")
        timed = [(a, b) for a, b in zip(none["per_step"], cham["per_step"])
                 if a["timed"] and a["train"] and "seconds" in a and "seconds" in b]
        for a, b in zip(none["per_step"], cham["per_step"]):
            steps.append({
                "workload": name, "step": a["step"], "tag": a["tag"], "train": a["train"],
                "tokens": a["tokens"], "timed": a["timed"],
                "seconds_none": a.get("seconds"), "seconds_engine": b.get("seconds"),
                "loss_none": a.get("loss"), "loss_engine": b.get("loss"),
                "loss_identical": a.get("loss") == b.get("loss") and "loss" in a,
                "peak_resident_bytes": b.get("activation_peak_bytes"),
                "saved_bytes": b.get("saved_bytes"), "budget_bytes": budget,
                "offloaded_bytes": b.get("moved_bytes"), "stall_seconds": b.get("stall_seconds"),
                "sync_fetches": b.get("sync_fetches"),
                "sequence_changed": b.get("sequence_changed"), "plan_source": b.get("plan_source")})
        ratios = [b["seconds"] / a["seconds"] for a, b in timed if a["seconds"] > 0]
        mine = [s for s in steps if s["workload"] == name]
        per_workload[name] = {
            "natural_peak_bytes": naturals[name],
            "budget_fraction_of_natural": budget / naturals[name] if naturals[name] else None,
            "max_peak_resident_bytes": cham["activation_peak_bytes"],
            "budget_held": cham["budget_held"],
            "overhead_ratio": (sum(b["seconds"] for _, b in timed) /
                               sum(a["seconds"] for a, _ in timed)) if timed else None,
            "overhead_ratio_median_step": statistics.median(ratios) if ratios else None,
            "step_seconds_median_none": none["step_seconds_median"],
            "step_seconds_median_engine": cham["step_seconds_median"],
            "offloaded_bytes": cham["moved_bytes"], "stall_seconds": cham["stall_seconds"],
            "sync_fetches": cham["sync_fetches"],
            "sequence_changes": cham["sequence_changes"],
            "changes_served_by": cham["changes_served_by"], "plan_sources": cham["plan_sources"],
            "losses_identical": bool(cham["losses_identical"]),
            "steps_run": sum(1 for s in mine if s["seconds_engine"] is not None),
            "error": cham["error"] or none["error"]}
    w = per_workload.values()
    timed = [s for s in steps if s["timed"] and s["train"] and s["seconds_none"]]
    peaks = [p["max_peak_resident_bytes"] for p in w if p["max_peak_resident_bytes"] is not None]
    return {
        **env, "command": "chameleon-swap demo", "policy": "chameleon", "size": cfg.size,
        "budget_bytes": budget, "budget_fraction": FRACTION,
        "natural_peak_bytes": max(naturals.values()),
        "max_peak_resident_bytes": max(peaks) if peaks else None,
        "budget_held": all(p["budget_held"] for p in w),
        "losses_identical": all(p["losses_identical"] for p in w),
        "overhead_ratio": (sum(s["seconds_engine"] for s in timed) /
                           sum(s["seconds_none"] for s in timed)) if timed else None,
        "sequence_changes": sum(p["sequence_changes"] or 0 for p in w),
        "steps_per_workload": cfg.warmup + cfg.steps, "warmup_steps": cfg.warmup,
        "cpu_threads": records[0]["cpu_threads"] if records else None,
        "workloads": per_workload, "steps": steps}


def _served(p: dict) -> str:
    by = p["changes_served_by"] or {}
    return ", ".join(f"{k} {v}" for k, v in sorted(by.items())) or "-"


def screen(summary: dict, figure: Optional[Path], out_dir: Path) -> str:
    w = summary["workloads"]
    names = list(w)
    rows = [
        ("natural activation peak", [format_bytes(w[n]["natural_peak_bytes"]) for n in names]),
        ("budget (share of that)", [f"{format_bytes(summary['budget_bytes'])} "
                                    f"({w[n]['budget_fraction_of_natural']:.0%})" for n in names]),
        ("peak kept on the device", [f"{format_bytes(w[n]['max_peak_resident_bytes'])} "
                                     f"({'held' if w[n]['budget_held'] else 'BROKEN'})"
                                     for n in names]),
        ("moved to host", [format_bytes(w[n]["offloaded_bytes"]) for n in names]),
        ("step time vs no engine", [f"{w[n]['overhead_ratio']:.2f}x total, "
                                    f"{w[n]['overhead_ratio_median_step']:.2f}x median"
                                    if w[n]["overhead_ratio"] else "-" for n in names]),
        ("sequence changes", [str(w[n]["sequence_changes"]) for n in names]),
        ("  served by", [_served(w[n]) for n in names]),
        ("all steps by source", [", ".join(f"{k} {v}" for k, v in sorted(
            (w[n]["plan_sources"] or {}).items())) for n in names]),
        ("losses identical", [f"{'yes' if w[n]['losses_identical'] else 'NO'} "
                              f"({w[n]['steps_run']} steps)" for n in names]),
    ]
    width = max(len(r[0]) for r in rows) + 2
    col = max(28, *(len(v) + 2 for _, vals in rows for v in vals))
    lines = [f"chameleon-swap demo on {summary['device_name']} ({summary['device']}, "
             f"{summary['cpu_threads']} compute thread(s)), torch {summary['torch']}",
             f"{summary['steps_per_workload']} steps per workload ({summary['warmup_steps']} "
             f"warm-up), policy 'chameleon', one budget {format_bytes(summary['budget_bytes'])} "
             f"= {summary['budget_fraction']:.0%} of the larger natural activation peak: "
             + ", ".join(f"{w[n]['budget_fraction_of_natural']:.0%} of {n}'s" for n in names), "",
             " " * width + "".join(n.ljust(col) for n in names),
             " " * width + "".join(("-" * (col - 2)).ljust(col) for _ in names)]
    for label, vals in rows:
        lines.append(label.ljust(width) + "".join(v.ljust(col) for v in vals))
    ok = summary["budget_held"] and summary["losses_identical"]
    lines += ["", "cache: the plan made for this exact operator sequence, found again; planned: a "
              "plan applied tensor by tensor",
              "(by module, call, ordinal, dtype and shape) to a sequence it was not made for, or "
              "the previous step's; guard: no plan yet",
              "", ("budget held on every step and every loss bit-for-bit the one without the "
                   "engine" if ok else "SOMETHING WENT WRONG: see above"),
              f"overall step time with the engine: {summary['overhead_ratio']:.2f}x no engine "
              f"(timed steps)" if summary["overhead_ratio"] else "",
              f"wrote {out_dir / 'summary.json'}" + (f" and {figure}" if figure else "")]
    choice = summary.get("choice") or {}
    lines += ["", "keep, swap or recompute, against gradient checkpointing:"]
    lines += (choice_leg.table(choice) if "legs" in choice
              else [f"  {choice.get('skipped', 'not run')}"])
    wall = summary.get("wall_seconds")
    if wall:
        lines += ["", f"the demo took {wall['total']:.0f} s ({wall['swapping']:.0f} s the "
                      f"swapping workloads, {wall['choice']:.0f} s the comparison; its last figure "
                      f"not counted)"]
    return "\n".join(lines)


def plot_demo(summary: dict, path: Path) -> Optional[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(summary["workloads"])
    fig, axes = plt.subplots(3, len(names), figsize=(6.5 * len(names), 8.5), squeeze=False,
                             sharex="col", gridspec_kw={"height_ratios": [3, 3, 1]})
    budget = summary["budget_bytes"] / 2**20
    for c, name in enumerate(names):
        st = [s for s in summary["steps"] if s["workload"] == name]
        x = [s["step"] for s in st]
        ax = axes[0][c]
        ax.bar(x, [(s["saved_bytes"] or 0) / 2**20 for s in st], color="#cccccc",
               label="saved by the step (what no engine keeps)")
        ax.plot(x, [(s["peak_resident_bytes"] or 0) / 2**20 for s in st], "o-", markersize=3,
                color="#2ca02c", label="kept on the device (engine)")
        ax.axhline(budget, color="#d62728", linestyle="--", label="budget")
        ax.set_ylabel("MiB of saved activations")
        ax.set_title(f"{name}: {summary['workloads'][name]['sequence_changes']} sequence changes, "
                     f"losses identical: {summary['workloads'][name]['losses_identical']}")
        ax.legend(fontsize=7, loc="upper right")
        ax = axes[1][c]
        ax.plot(x, [(s["seconds_none"] or 0) * 1e3 for s in st], "s-", markersize=3,
                label="no engine")
        ax.plot(x, [(s["seconds_engine"] or 0) * 1e3 for s in st], "o-", markersize=3,
                label="chameleon")
        ax.set_ylabel("step ms")
        ax.legend(fontsize=7, loc="upper right")
        ax = axes[2][c]
        for s in st:
            if s["plan_source"]:
                ax.barh(0, 1, left=s["step"] - 0.5, color=SOURCES.get(s["plan_source"], "#999"),
                        height=0.8)
            if s["sequence_changed"]:
                ax.plot(s["step"], 0, marker="v", color="black", markersize=4)
        ax.set_yticks([])
        ax.set_xlabel("step  (plan source: " + ", ".join(
            f"{k}={v}" for k, v in {"guard": "red", "planned": "green", "cache": "blue",
                                    "replanned": "orange"}.items())
            + "; v = sequence changed)")
    fig.suptitle(f"chameleon-swap demo on {summary['device_name']}: budget "
                 f"{format_bytes(summary['budget_bytes'])}, "
                 f"{summary['overhead_ratio']:.2f}x the step time of no engine"
                 if summary["overhead_ratio"] else "chameleon-swap demo")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

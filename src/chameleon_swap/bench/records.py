"""Records: what one (workload, baseline, budget) did, as a flat JSON-ready dict.

One record per engine run (a policy at a budget); a baseline without a budget runs once and gets a
record per budget, since whether it *fits* depends on the budget (see ``harness``). Each record
carries the environment (device, torch, commit), the config, the medians and a ``per_step`` list.
"""
from __future__ import annotations

import statistics
from typing import Optional

import torch

from .baselines import ENGINE_POLICIES


def _q(xs: list, q: float) -> Optional[float]:
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=4, method="inclusive")[{0.25: 0, 0.5: 1, 0.75: 2}[q]]


def _equal_losses(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def records(cfg, workload, runs: list, info: dict, env: dict) -> list[dict]:
    """One record per (baseline, budget); baselines without a budget get one per budget."""
    natural = info["natural_peak_bytes"]
    schedule = info["schedule"]
    timed = list(range(cfg.warmup, cfg.warmup + cfg.steps))
    none = next((r for r in runs if r.baseline == "none"), None)

    def peak_of(run) -> Optional[int]:
        if run.device_peaks:
            return max(run.device_peaks)
        return max(run.metered_peaks) if run.metered_peaks else None

    # Per step, per budget: the memory the budget implies (see harness), from the no-engine run.
    caps = none.metered_caps if none is not None and not none.error else []
    none_median = None
    if none is not None and len(none.seconds) == len(schedule):
        none_median = statistics.median(none.seconds[i] for i in timed if schedule[i]["train"])
    out = []
    for run in runs:
        budgets = [run.budget] if run.budget is not None else cfg.parsed_budgets
        for b in budgets:
            out.append(_record(cfg, workload, run, b, b.resolve(natural), natural, schedule,
                               timed, none, caps, none_median, peak_of(run), env))
    return out


def _record(cfg, workload, run, budget, budget_bytes, natural, schedule, timed, none,
            caps, none_median, peak, env) -> dict:
    complete = not run.error and len(run.seconds) == len(schedule)
    train_timed = [i for i in timed if schedule[i]["train"]] if complete else []
    secs = [run.seconds[i] for i in train_timed]
    med = statistics.median(secs) if secs else None
    tokens = sum(schedule[i]["tokens"] for i in train_timed)
    stats = run.stats if complete else []
    tot = lambda k: sum(s.get(k) or 0 for s in stats) if any(k in s for s in stats) else None  # noqa: E731
    step_caps = [c[budget_bytes] for c in caps]
    cap = max(step_caps) if step_caps else None
    act_peaks = [s["activation_peak_bytes"] for s in stats if "activation_peak_bytes" in s]
    engine = run.baseline in ENGINE_POLICIES
    identical = None
    if none is not None and complete and run is not none:
        identical = _equal_losses(run.losses, none.losses) and (
            not run.metered_losses or _equal_losses(run.metered_losses, none.metered_losses))
    elif run is none and complete:
        identical = True
    fits = None
    if step_caps and len(run.metered_peaks) == len(step_caps):
        fits = all(p <= c + k["largest"]
                   for p, c, k in zip(run.metered_peaks, step_caps, caps))
    elif step_caps and run.oom:
        fits = False
    per_step = []
    for i, item in enumerate(schedule):
        rec = {"step": i, **item, "timed": i in timed}
        if i < len(run.seconds):
            rec["seconds"] = run.seconds[i]
            rec["loss"] = float(run.losses[i])
            s = run.stats[i] if i < len(run.stats) else {}
            for k in ("activation_peak_bytes", "saved_bytes", "plan_source", "sequence_changed",
                      "moved_bytes", "stall_seconds", "sync_fetches"):
                if k in s:
                    rec[k] = s[k]
        if i < len(run.metered_peaks):
            rec["metered_peak_bytes"] = run.metered_peaks[i]
        if i < len(step_caps):
            rec["memory_cap_bytes"] = step_caps[i]
        if i < len(run.device_peaks):
            rec["device_peak_bytes"] = run.device_peaks[i]
        per_step.append(rec)
    changed = [s for s in stats if s.get("sequence_changed")]
    return {
        **env,
        "workload": workload.name, "baseline": run.baseline, "label": run.label,
        "budget": budget.label, "budget_bytes": budget_bytes,
        "budget_applies": engine, "natural_peak_bytes": natural,
        "steps": cfg.steps, "warmup": cfg.warmup, "size": cfg.size,
        "config": {"workload": workload.config_dict(), "lr": cfg.lr, "seed": cfg.seed,
                   "interleave": cfg.interleave, "meter": cfg.meter},
        "step_seconds_median": med,
        "step_seconds_p25": _q(secs, 0.25), "step_seconds_p75": _q(secs, 0.75),
        "step_seconds_iqr": (_q(secs, 0.75) - _q(secs, 0.25)) if secs else None,
        "ratio_vs_none": (med / none_median) if med and none_median else None,
        "tokens_per_second": (tokens / sum(secs)) if secs else None,
        "peak_bytes": peak,
        "peak_source": ("cuda max_memory_allocated" if run.device_peaks else
                        "meter" if run.metered_peaks else None),
        "memory_cap_bytes": cap, "fits": fits,
        "activation_peak_bytes": max(act_peaks) if act_peaks else None,
        "budget_held": (all(p <= budget_bytes for p in act_peaks) if engine and act_peaks
                        else fits),
        "moved_bytes": tot("moved_bytes"), "fetched_bytes": tot("fetched_bytes"),
        "stall_seconds": tot("stall_seconds"), "sync_fetches": tot("sync_fetches"),
        "sequence_changes": len(changed) if engine else None,
        "changes_served_by": ({src: sum(s["plan_source"] == src for s in changed)
                               for src in sorted({s["plan_source"] for s in changed})}
                              if engine else None),
        "plan_sources": ({src: sum(s["plan_source"] == src for s in stats)
                          for src in sorted({s["plan_source"] for s in stats})}
                         if engine else None),
        "oom": run.oom, "error": run.error, "losses_identical": identical,
        "per_step": per_step,
    }

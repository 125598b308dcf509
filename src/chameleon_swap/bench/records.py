"""Records: what one (workload, baseline, budget) did, as a flat JSON-ready dict.

One record per engine run (a policy at a budget); a baseline without a budget runs once and gets a
record per budget, since whether it *fits* depends on the budget (see ``harness``). Each record
carries the environment (device, torch, commit), the config, the medians and a ``per_step`` list.

Exactness: ``losses_identical`` compares a run's losses (both passes) with ``none``'s bit for bit.
The harness runs ``none`` twice; ``reference_reproducible`` says whether those two runs agree bit
for bit and ``reference_max_diff`` by how much they differ at most. Where the reference is
reproducible the bitwise comparison is the whole check (``losses_within_reference`` is None).
Where it is not, ``losses_max_diff`` is a run's largest difference from ``none`` over the steps
and ``losses_within_reference`` whether that is at most ``reference_max_diff``: a baseline can be
no more exact than the plain step is with itself.
"""
from __future__ import annotations

import math
import statistics
from typing import Optional

import torch

from .baselines import ENGINE_BASELINES


def _q(xs: list, q: float) -> Optional[float]:
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=4, method="inclusive")[{0.25: 0, 0.5: 1, 0.75: 2}[q]]


def _equal_losses(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def max_loss_diff(a: list, b: list) -> Optional[float]:
    """Largest absolute difference of two runs' losses, step by step (in float64); None when they
    have different lengths (a run that stopped) or no steps. NaN where a loss is NaN."""
    if len(a) != len(b) or not a:
        return None
    return nan_max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def nan_max(xs) -> float:
    """max that returns NaN when any value is NaN (Python's max depends on the order)."""
    xs = list(xs)
    return math.nan if any(math.isnan(x) for x in xs) else max(xs)


def median_interval(values: list, confidence: float = 0.95):
    """The median of ``values`` and a distribution-free interval for it: order statistics
    ``k`` and ``n + 1 - k`` (1-based), with ``k`` the largest for which at most
    ``(1 - confidence) / 2`` of Binomial(n, 1/2) lies below ``k`` (the sign test's interval; 23
    values give the 7th and 17th, 96.5%). ``(median, None)`` where too few values give one
    (fewer than 6 at 95%)."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return None, None
    tail, k = 0.0, 0
    while True:
        tail += math.comb(n, k) / 2 ** n       # P(X <= k), X ~ Binomial(n, 1/2)
        if tail > (1 - confidence) / 2:
            break
        k += 1
    if k == 0:
        return statistics.median(xs), None
    return statistics.median(xs), (xs[k - 1], xs[n - k])


def _count_modes(stats: list) -> Optional[dict]:
    modes = [tuple(s["block_modes"]) for s in stats if s.get("block_modes")]
    if not modes:
        return None
    return {",".join(map(str, m)): modes.count(m) for m in dict.fromkeys(modes)}


def reference_check(none, repeat) -> tuple[Optional[bool], Optional[float]]:
    """(bitwise reproducible?, largest difference) of the reference's two timed runs; (None, None)
    when either is missing or incomplete."""
    if none is None or repeat is None or none.error or repeat.error:
        return None, None
    if len(none.losses) != len(repeat.losses) or not none.losses:
        return None, None
    return _equal_losses(none.losses, repeat.losses), max_loss_diff(none.losses, repeat.losses)


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
    reference = reference_check(none, info.get("reference_repeat"))
    none_median = None
    if none is not None and len(none.seconds) == len(schedule):
        none_median = statistics.median(none.seconds[i] for i in timed if schedule[i]["train"])
    out = []
    for run in runs:
        budgets = [run.budget] if run.budget is not None else cfg.parsed_budgets
        for b in budgets:
            out.append(_record(cfg, workload, run, b, b.resolve(natural), natural, schedule,
                               timed, none, caps, none_median, peak_of(run), env, reference))
    return out


def _record(cfg, workload, run, budget, budget_bytes, natural, schedule, timed, none,
            caps, none_median, peak, env, reference=(None, None)) -> dict:
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
    engine = run.baseline in ENGINE_BASELINES
    identical = max_diff = within = None
    reproducible, reference_diff = reference
    if none is not None and complete and run is not none:
        identical = _equal_losses(run.losses, none.losses) and (
            not run.metered_losses or _equal_losses(run.metered_losses, none.metered_losses))
        diffs = [max_loss_diff(run.losses, none.losses)]
        if run.metered_losses:
            diffs.append(max_loss_diff(run.metered_losses, none.metered_losses))
        max_diff = None if None in diffs else nan_max(diffs)
        if reproducible is False:
            # Not NaN-safe by accident: a NaN difference compares False, so it is never within.
            within = max_diff is not None and max_diff <= reference_diff
    elif run is none and complete:
        identical = True
        max_diff = 0.0
        if reproducible is False:
            within = True
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
                      "moved_bytes", "stall_seconds", "sync_fetches", "block_modes",
                      "recomputed_bytes", "predicted_stall_seconds", "predicted_step_seconds"):
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
        # Block modes (keep, selective, full) the steps ran, and how many steps ran each:
        # {"8,0,0": 5, "5,3,0": 1}; None where the engine runs no blocks (swap only, peers).
        "block_modes": _count_modes(stats) if engine else None,
        "plan_sources": ({src: sum(s["plan_source"] == src for s in stats)
                          for src in sorted({s["plan_source"] for s in stats})}
                         if engine else None),
        "oom": run.oom, "error": run.error, "losses_identical": identical,
        "reference_reproducible": reproducible, "reference_max_diff": reference_diff,
        "losses_max_diff": max_diff, "losses_within_reference": within,
        "per_step": per_step,
    }

"""Calibration: predict real runs from their traces and measure how far off the predictions are.

For a workload, its schedule of batches is run by several engines side by side, in rotating order:

* the *reference*: ``Chameleon(budget=None, trace_dir=...)``: nothing moves, every slot is timed;
  its traces are what the simulator predicts from;
* ``none``: the engine again without a budget (hooks on, not traced): predicted by the trace's
  compute alone;
* each policy (guard, static, chameleon) at each budget (fractions of the schedule's largest
  natural peak): predicted by ``policies.run`` on the reference trace with the same budget and
  the measured copy bandwidth.

One pass over the schedule warms every engine up (shapes seen, plans made and cached); then
``repeats`` passes are measured. Per engine and batch the median of the repeats is compared with
the prediction from the reference's median segment times, so that a stray slow step (a shared
machine) does not count as a model error. Planned policies are predicted warm, as they run after
the warm-up pass: every sequence has been seen.

The error of a step is ``|predicted - measured| / measured``, for step time (``step_seconds``) and
peak (``peak_resident_bytes``, the engine's own accounting, which the timeline models). Evaluation
steps (no backward) save nothing and are left out.
"""
from __future__ import annotations

import statistics
import tempfile
from typing import Callable, Optional

from .policies import run
from ..runtime.trace import Step, Trace, load

POLICIES = ("guard", "static", "chameleon")
FRACTIONS = (0.5, 0.25)


def calibrate(workload: str, *, size: str = "small", steps: int = 8, repeats: int = 3,
              fractions=FRACTIONS, policies=POLICIES, device: str = "cpu", seed: int = 0,
              advance: Callable[[], None] = lambda: None) -> dict:
    """Run the calibration of one workload; ``advance`` is called after every batch of every
    pass (``(repeats + 1) * steps`` calls)."""
    import torch

    from chameleon_swap.copy.bandwidth import cached_bandwidth
    from chameleon_swap.workloads import get_workload

    if repeats < 1 or steps < 1:
        raise ValueError(f"steps and repeats must be positive ints; got {steps}, {repeats}")
    wl = get_workload(workload, size)
    dev = torch.device(device)
    model = wl.build(dev, torch.float32, seed)
    batches = wl.batches(steps, dev, seed)

    def one(batch, eng) -> None:
        model.zero_grad(set_to_none=True)
        with eng.step():
            wl.run(model, batch)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    natural = _natural_peak(one, batches, dev)
    budgets = {f: int(natural * f) for f in fractions}
    measured, refs = _measure(one, batches, dev, budgets, policies, repeats, advance)
    trace = Trace(steps=[_median_step(r) for r in refs], source="profiler",
                  meta={"workload": workload, "size": size})
    bw = cached_bandwidth(dev)
    link = (bw.d2h_bytes_per_s, bw.h2d_bytes_per_s)
    train = [i for i, b in enumerate(batches) if b.train and trace.steps[i].n_forward > 0]
    configs = [("none", None, None)] + [(p, f, budgets[f]) for p in policies for f in fractions]
    rows = _compare(trace, measured, configs, train, [b.tag for b in batches], link)
    return {"workload": workload, "size": size, "steps": steps, "repeats": repeats,
            "device": str(dev), "natural_peak_bytes": natural,
            "budgets": {str(f): b for f, b in budgets.items()},
            "link_bytes_per_s": {"d2h": link[0], "h2d": link[1]},
            "reference_step_s": [statistics.median(x.step_seconds for x in measured["reference"][i])
                                 for i in train],
            "rows": rows, "summary": summarize(rows)}


def _natural_peak(one: Callable, batches: list, dev) -> int:
    """The largest natural peak of the schedule (an engine without a budget), which the budgets
    are fractions of."""
    import chameleon_swap as cs

    with cs.Chameleon(None, device=dev) as probe:
        peaks = []
        for b in batches:
            one(b, probe)
            peaks.append(probe.last_step.peak_resident_bytes)
    return max(peaks)


def _measure(one: Callable, batches: list, dev, budgets: dict, policies, repeats: int,
             advance: Callable[[], None]) -> tuple[dict, list]:
    """Every engine run over the schedule ``repeats + 1`` times, side by side in rotating order,
    the first pass a warm-up. Returns each engine's ``StepStats`` per batch (keys "reference",
    "none", (policy, fraction)) and the reference's traced steps per batch."""
    import chameleon_swap as cs

    with tempfile.TemporaryDirectory() as tdir:
        engines = {"none": cs.Chameleon(None, device=dev)}
        for p in policies:
            for f, b in budgets.items():
                engines[(p, f)] = cs.Chameleon(b, device=dev, policy=p)
        names = ["reference", *engines]
        measured: dict = {n: [[] for _ in batches] for n in names}
        refs = [[] for _ in batches]
        try:
            for rep in range(repeats + 1):
                # A fresh traced engine per pass keeps each pass's files apart.
                engines["reference"] = cs.Chameleon(None, device=dev,
                                                    trace_dir=f"{tdir}/pass{rep}")
                for i, batch in enumerate(batches):
                    k = (i + rep) % len(names)
                    for n in names[k:] + names[:k]:
                        one(batch, engines[n])
                        if rep:
                            measured[n][i].append(engines[n].last_step)
                    advance()
                engines.pop("reference").close()
                if rep:
                    for i, step in enumerate(load(f"{tdir}/pass{rep}").steps):
                        refs[i].append(step)
        finally:
            for e in engines.values():
                e.close()
    return measured, refs


def _compare(trace: Trace, measured: dict, configs: list, train: list, tags: list,
             link: tuple) -> list[dict]:
    """One row per (policy, fraction, budget) in ``configs`` and training step: the median of the
    measured repeats against the prediction of ``policies.run`` on the reference ``trace``."""
    from chameleon_swap.config import DEFAULT_MIN_TENSOR_BYTES

    rows = []
    for p, f, budget in configs:
        name = "none" if p == "none" else (p, f)
        pred = run(trace, p, budget, link=link, min_tensor_bytes=DEFAULT_MIN_TENSOR_BYTES)
        for i in train:
            ms, r = measured[name][i], pred.steps[i]
            m_step = statistics.median(x.step_seconds for x in ms)
            m_peak = statistics.median(x.peak_resident_bytes for x in ms)
            m_stall = statistics.median(x.stall_seconds for x in ms)
            m_moved = statistics.median(x.offloaded_bytes for x in ms)
            peak = r.counted_peak_bytes if r.counted_peak_bytes is not None else r.peak_bytes
            rows.append({"policy": p, "fraction": f, "step": i, "tag": tags[i],
                         "measured_step_s": m_step, "predicted_step_s": r.step_seconds,
                         "measured_peak_bytes": m_peak, "predicted_peak_bytes": peak,
                         "measured_stall_s": m_stall, "predicted_stall_s": r.stall_seconds,
                         "measured_moved_bytes": m_moved, "predicted_moved_bytes": r.moved_bytes,
                         "step_error": _err(r.step_seconds, m_step),
                         "peak_error": _err(peak, m_peak)})
    return rows


def _median_step(steps: list) -> Step:
    """The step with every segment's median over repeated runs of one batch (the same operator
    sequence each time); the run with the median total when the sequences differ."""
    first = steps[0]
    same = all(len(s.segments) == len(first.segments) and s.n_forward == first.n_forward
               and [t.nbytes for t in s.tensors] == [t.nbytes for t in first.tensors]
               for s in steps)
    if not same:
        return sorted(steps, key=lambda s: s.compute_seconds)[len(steps) // 2]
    segs = [statistics.median(col) for col in zip(*(s.segments for s in steps))]
    return Step(segments=segs, n_forward=first.n_forward, tensors=list(first.tensors),
                model_state_bytes=first.model_state_bytes, tag=first.tag,
                measured=first.measured)


def _err(predicted: float, measured: float) -> Optional[float]:
    if measured == 0:
        return 0.0 if predicted == 0 else None
    return abs(predicted - measured) / measured


def summarize(rows: list[dict]) -> dict:
    """Median (and worst) step-time and peak errors, overall and per policy and budget."""
    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    def worst(xs):
        xs = [x for x in xs if x is not None]
        return max(xs) if xs else None
    groups: dict = {}
    for r in rows:
        groups.setdefault(r["policy"] if r["fraction"] is None
                          else f"{r['policy']}@{r['fraction']}", []).append(r)
    out = {"median_step_error": med(r["step_error"] for r in rows),
           "median_peak_error": med(r["peak_error"] for r in rows),
           "max_step_error": worst(r["step_error"] for r in rows),
           "max_peak_error": worst(r["peak_error"] for r in rows), "by_config": {}}
    for k, rs in groups.items():
        out["by_config"][k] = {"median_step_error": med(r["step_error"] for r in rs),
                               "median_peak_error": med(r["peak_error"] for r in rs),
                               "median_measured_step_s": med(r["measured_step_s"] for r in rs),
                               "median_predicted_step_s": med(r["predicted_step_s"] for r in rs),
                               "median_measured_stall_s": med(r["measured_stall_s"] for r in rs),
                               "median_predicted_stall_s": med(r["predicted_stall_s"] for r in rs),
                               "median_measured_moved_bytes":
                                   med(r["measured_moved_bytes"] for r in rs),
                               "median_predicted_moved_bytes":
                                   med(r["predicted_moved_bytes"] for r in rs)}
    return out

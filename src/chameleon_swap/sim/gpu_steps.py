"""Simulated step times of traced models against step times measured on a GPU.

A ``Measured`` run names a Hugging Face config, the sequence length it is simulated at, and what
was measured: the plain step's seconds, full recomputation's and the engine's step times as
ratios to it. ``step_table`` traces each config (``hf_trace``), times it on a hardware profile and
returns the simulated figures beside the measured ones with their relative errors. With
``fit=True`` it first fits one factor, the matmul fraction of peak FLOP/s the device reaches
(``Hardware.achievable_fraction``), to the plain steps alone; the other columns (recomputation,
swapping, which also depend on the link and the planner) are then the test of the model.

Recomputation is simulated from the same trace as the plain step: a block's recompute is its own
forward segments, whose seconds come from the traced ops' FLOPs and bytes.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from .hardware import Hardware
from .policies import run

FRACTIONS = (0.25, 0.5)              # engine budgets measured, of the natural activation peak
HYBRID_FRACTIONS = (0.25, 0.5, 0.75)


@dataclass(frozen=True)
class Measured:
    label: str
    spec: str                        # config.json path or model_type, as ``--hf`` takes
    seq: int                         # tokens per step simulated (one sequence)
    none_seconds: float
    recompute_ratio: float
    engine_ratio: dict = field(default_factory=dict)   # budget fraction -> median step ratio
    overrides: dict = field(default_factory=dict)      # config fields set on top of ``spec``
    peak_bytes: Optional[int] = None   # max_memory_allocated above the step start, plain step


# One NVIDIA H100 80GB HBM3, measured by the project on 2026-11-23 (PyTorch 2.11, transformers
# 5.17): LlamaForCausalLM from a config, SDPA, fp32 weights under bf16 autocast, SGD, batch 1,
# trained on a schedule of lengths; medians over the steps; the peak is the plain step's at the
# longest length. "recompute" is
# gradient_checkpointing_enable() (non-reentrant); the engine ran Chameleon(budget=fraction x
# the plain step's activation peak) with its default (swap-only) policy. The configs are not
# recorded with the runs: heads = hidden / 128, intermediate 2.6875 x hidden, vocabulary 32000
# (docs/configs/llama-h*.json). The schedules were 4k-16k, 8k-16k and 6k-8k tokens; each is
# simulated at its longest length.
H100_LLAMA = (
    Measured("hidden 2048, 16 layers", "docs/configs/llama-h2048-l16.json", 16384, 0.37, 1.17,
             {0.25: 2.5}, peak_bytes=round(36.9 * 2**30)),
    Measured("hidden 4096, 8 layers", "docs/configs/llama-h4096-l8.json", 16384, 0.51, 1.14,
             {0.25: 2.1, 0.5: 1.19}, peak_bytes=round(38.8 * 2**30)),
    Measured("hidden 8192, 4 layers", "docs/configs/llama-h8192-l4.json", 8192, 0.37, 1.20,
             {0.25: 1.94, 0.5: 1.35}, peak_bytes=round(24.7 * 2**30)),
)


def _trace(m: Measured, hw: Hardware, trace_fn: Callable):
    from .hf_trace import to_trace
    rec = trace_fn(m.spec, seq=m.seq, micro_batch=1, dtype="bf16", **m.overrides)
    return rec, to_trace(rec, hw, "sgd", m.label)


def _none_seconds(rec, hw: Hardware) -> float:
    from .hf_trace import to_trace
    return to_trace(rec, hw, "sgd").steps[0].compute_seconds


def fit_fraction(recs: list, measured: list, hw: Hardware, lo: float = 0.05,
                 hi: float = 1.0) -> float:
    """The ``achievable_fraction`` in [lo, hi] that minimises the squared log error of the plain
    steps' simulated seconds against the measured ones (golden-section search: the error is
    unimodal in the fraction, each step time falling as it grows)."""
    def loss(f: float) -> float:
        h = dataclasses.replace(hw, achievable_fraction=f)
        return sum(math.log(_none_seconds(r, h) / m.none_seconds) ** 2
                   for r, m in zip(recs, measured))
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = loss(c), loss(d)
    while b - a > 1e-4:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = loss(d)
    return (a + b) / 2


def _err(sim: float, meas: Optional[float]) -> Optional[float]:
    return None if meas is None else sim / meas - 1


def simulate_run(trace, fractions=FRACTIONS, hybrid_fractions=HYBRID_FRACTIONS) -> dict:
    """A traced step's plain seconds, recompute ratio, chameleon (swap only) and hybrid ratios
    at budgets that are fractions of its natural activation peak."""
    step = trace.steps[0]
    peak = step.activation_bytes
    none = run(trace, "none", None).step_seconds
    out = {"none_seconds": none, "activation_bytes": peak,
           "recompute_ratio": run(trace, "full-recompute", None).step_seconds / none,
           "chameleon": {}, "hybrid": {}}
    cache: dict = {}
    for f in fractions:
        out["chameleon"][f] = run(trace, "chameleon", int(f * peak),
                                  plan_cache=cache).step_seconds / none
    for f in hybrid_fractions:
        out["hybrid"][f] = run(trace, "hybrid", int(f * peak), plan_cache=cache).step_seconds / none
    return out


def step_table(hw: Hardware, runs=H100_LLAMA, *, fit: bool = True,
               trace_fn: Optional[Callable] = None) -> dict:
    """Measured vs simulated step times of ``runs`` on ``hw`` (see the module docstring).
    Returns the profile's and the fitted fraction, and per run the measured figures, the
    simulated ones and their relative errors (None where nothing was measured)."""
    if trace_fn is None:
        from .hf_trace import trace_hf as trace_fn
    runs = list(runs)
    recs = [trace_fn(m.spec, seq=m.seq, micro_batch=1, dtype="bf16", **m.overrides)
            for m in runs]
    profile_none = [_none_seconds(r, hw) for r in recs]
    fitted = fit_fraction(recs, runs, hw) if fit else hw.achievable_fraction
    timed = dataclasses.replace(hw, achievable_fraction=fitted)
    rows = []
    from .hf_trace import to_trace
    for m, rec, pn in zip(runs, recs, profile_none):
        sim = simulate_run(to_trace(rec, timed, "sgd", m.label))
        rows.append({
            "label": m.label, "seq": m.seq, "measured": {
                "none_seconds": m.none_seconds, "recompute_ratio": m.recompute_ratio,
                "chameleon": {f: m.engine_ratio.get(f) for f in FRACTIONS}},
            "simulated": sim,
            "profile_none_seconds": pn,
            "error": {"profile_none": _err(pn, m.none_seconds),
                      "none": _err(sim["none_seconds"], m.none_seconds),
                      "recompute": _err(sim["recompute_ratio"], m.recompute_ratio),
                      "chameleon": {f: _err(sim["chameleon"][f], m.engine_ratio.get(f))
                                    for f in FRACTIONS}}})
    return {"hardware": hw.name, "profile_fraction": hw.achievable_fraction,
            "fitted_fraction": fitted, "fit": fit, "link": (hw.d2h, hw.h2d), "rows": rows}


def within(table: dict, tolerance: float = 0.15) -> dict:
    """Per column, whether every measured cell is within ``tolerance`` (relative error)."""
    cols: dict = {"none": [], "recompute": []}
    for r in table["rows"]:
        cols["none"].append(r["error"]["none"])
        cols["recompute"].append(r["error"]["recompute"])
        for f, e in r["error"]["chameleon"].items():
            cols.setdefault(f"chameleon@{f:.0%}", []).append(e)
    return {k: all(abs(e) <= tolerance for e in v if e is not None) for k, v in cols.items()}

"""What ``simulate``, ``capacity`` and ``compare`` compute, apart from their printing.

A *scenario* is a model configuration on a hardware profile. ``evaluate`` simulates one policy on
it; the activation budget defaults to what the device leaves once model states, the transient
workspace and the runtime's reserve are taken (``default_budget``). ``tpN`` policies regenerate the
model at tensor-parallel degree N and run it without swapping. Memory *demand* is what the step
would need with nothing moved or recomputed: model states, natural activation peak, workspace
and reserve; ``capacity`` reports it as a multiple of device memory.
"""
from __future__ import annotations

from typing import Callable, Optional

from .analytic import generate
from .hardware import Hardware
from .models import ModelConfig, family, preset
from .policies import TP_RE, Result, run
from ..runtime.trace import Step

SEQ_STEP = 256            # sequence lengths are searched in multiples of this
MAX_SEQ = 2 ** 21
MAX_MICRO_BATCH = 4096
DEGREES = (1, 2, 4, 8)


def default_budget(step: Step, hw: Hardware) -> int:
    return max(0, hw.usable_bytes - step.model_state_bytes - step.workspace_bytes)


def demand_bytes(step: Step, hw: Hardware) -> int:
    return step.model_state_bytes + step.activation_bytes + step.workspace_bytes + hw.reserved_bytes


def evaluate(cfg: ModelConfig, hw: Hardware, policy: str, budget: Optional[int] = None,
             cache: Optional[dict] = None) -> tuple[Result, Step]:
    """Simulate ``policy`` on ``cfg`` timed by ``hw``; ``fits`` judged against ``hw``'s device
    memory (less its reserve) and host RAM."""
    m = TP_RE.match(policy)
    base = "none"
    if m:
        cfg = cfg.replace(tp=int(m.group(1)))
    else:
        base = policy
    trace = generate(cfg, hw)
    step = trace.steps[0]
    if budget is None or m:
        budget = default_budget(step, hw)
    r = run(trace, base, budget, device_bytes=hw.usable_bytes, host_bytes=hw.host_memory_bytes,
            plan_cache=cache)
    r.policy = policy
    return r, step


def _point(cfg: ModelConfig, hw: Hardware, policy: str, cache: dict) -> Optional[dict]:
    """The policy's figures on ``cfg`` when it fits, else None."""
    try:
        r, step = evaluate(cfg, hw, policy, cache=cache)
    except ValueError:
        return None          # e.g. tp does not divide the heads: not a deployable point
    if not r.fits:
        return None
    return {"step_seconds": r.step_seconds, "tokens_per_second": r.tokens_per_second,
            "peak_bytes": r.peak_bytes, "moved_bytes": r.moved_bytes,
            "demand_ratio": demand_bytes(step, hw) / hw.device_memory_bytes}


def _largest(fits: Callable[[int], Optional[dict]], start: int, unit: int, limit: int):
    """Largest multiple of ``unit`` in [start, limit] for which ``fits`` answers (doubling, then
    bisection: memory need grows with the value), and its answer; (None, None) if none fits."""
    got = fits(start)
    if got is None:
        return None, None
    lo, lo_got = start, got
    hi = None
    while hi is None:
        nxt = min(limit, lo * 2)
        if nxt == lo:
            return lo, lo_got
        got = fits(nxt)
        if got is None:
            hi = nxt
        else:
            lo, lo_got = nxt, got
    while hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        if mid <= lo:
            break
        got = fits(mid)
        if got is None:
            hi = mid
        else:
            lo, lo_got = mid, got
    return lo, lo_got


def capacity(cfg: ModelConfig, hw: Hardware, policies: list[str],
             advance: Callable[[], None] = lambda: None) -> dict:
    """For each policy: the largest model (of the dense presets, at ``cfg``'s run settings), the
    longest sequence and the largest micro-batch (for ``cfg``'s model) that fit, each with its
    throughput and memory demand there. ``advance`` is called after each policy and axis."""
    cache: dict = {}
    run_settings = dict(seq=cfg.seq, micro_batch=cfg.micro_batch, dtype=cfg.dtype,
                        flash=cfg.flash, tp=cfg.tp, dp_shard=cfg.dp_shard)
    out: dict = {}
    for p in policies:
        row: dict = {}
        best = None
        for name in family():
            try:
                c = preset(name, **run_settings)
            except ValueError:
                continue
            got = _point(c, hw, p, cache)
            if got is not None:
                best = {"model": name, "params": c.params(), **got}
        row["model"] = best
        advance()
        value, got = _largest(lambda s: _point(cfg.replace(seq=s), hw, p, cache),
                              SEQ_STEP, SEQ_STEP, MAX_SEQ)
        row["seq"] = None if value is None else {"seq": value, **got}
        advance()
        value, got = _largest(lambda b: _point(cfg.replace(micro_batch=b), hw, p, cache),
                              1, 1, MAX_MICRO_BATCH)
        row["micro_batch"] = None if value is None else {"micro_batch": value, **got}
        advance()
        out[p] = row
    return out


APPROACHES = ("chameleon", "hybrid", "full-recompute", "selective-recompute", "none")
# (key, swapping approach, the other): speedups reported by ``compare``.
SPEEDUPS = (("vs_full_recompute", "chameleon", "full-recompute"),
            ("vs_selective_recompute", "chameleon", "selective-recompute"),
            ("vs_tensor_parallel", "chameleon", "none"),
            ("hybrid_vs_full_recompute", "hybrid", "full-recompute"),
            ("hybrid_vs_selective_recompute", "hybrid", "selective-recompute"),
            ("hybrid_vs_tensor_parallel", "hybrid", "none"))


def speedups(row: dict) -> dict:
    """tokens/s per device of each swapping approach over each other one, minus 1 (None where
    either is absent from ``row`` or did not fit)."""
    out = {}
    for key, a, other in SPEEDUPS:
        x, o = row.get(a), row.get(other)
        out[key] = (x["tokens_per_second_per_device"] / o["tokens_per_second_per_device"] - 1
                    if x and o else None)
    return out


def parse_approaches(text: Optional[str]) -> list[str]:
    """``--approaches``: a comma-separated subset of ``APPROACHES`` (default: all)."""
    if not text:
        return list(APPROACHES)
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in APPROACHES]
    if bad or not names:
        raise ValueError(f"--approaches must be a comma-separated list from "
                         f"{', '.join(APPROACHES)}; got {text!r}")
    return names


def compare(models: list[str], hw: Hardware, run_settings: dict, degrees=DEGREES,
            advance: Callable[[], None] = lambda: None, approaches=APPROACHES) -> list[dict]:
    """Per model: each approach at the smallest tensor-parallel degree where it fits on ``hw``
    (equal memory: the same device), its tokens/s per device there, and chameleon's and
    hybrid's speedups over recomputation and over the higher-degree parallelism that runs
    without either."""
    cache: dict = {}
    rows = []
    for name in models:
        row: dict = {"model": name, "params": preset(name).params()}
        for a in approaches:
            row[a] = None
            for d in degrees:
                try:
                    cfg = preset(name, **{**run_settings, "tp": d})
                except ValueError:
                    continue          # the degree does not divide the heads
                r, _ = evaluate(cfg, hw, a, cache=cache)
                if r.fits:
                    row[a] = {"tp": d, "step_seconds": r.step_seconds,
                              "stall_seconds": r.stall_seconds,
                              "tokens_per_second_per_device": r.tokens_per_second / d}
                    break
            advance()
        row.update(speedups(row))
        rows.append(row)
    return rows

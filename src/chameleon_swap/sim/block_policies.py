"""Policies that act per block (a layer): full and selective recomputation, and the hybrid that
chooses keep, selective or full per block together with a swap set.

They need the step's block structure (which segments and tensors belong to which block); analytic
traces carry it. ``policies.run`` calls them; the recomputation model is described there.
"""
from __future__ import annotations

from typing import Optional

from ..planning.modes import Block, plan_hybrid
from ..planning.timeline import Plan, Prediction, simulate
from ..runtime.trace import Step


# ------------------------------------------------------------------------------- recomputation
def recompute_step(step: Step, policy: str) -> tuple[float, int]:
    """``full-recompute`` or ``selective-recompute`` on one step: (step seconds, peak bytes)."""
    if not step.has_blocks:
        raise ValueError(f"{policy} needs a trace with block (layer) structure: analytic traces "
                         f"have it, traces recorded by the profiler do not")
    full = policy == "full-recompute"
    blocks, kinds = step.segment_block, step.segment_kind or [""] * step.n_forward
    if full:
        drop = [j for j, t in enumerate(step.tensors)
                if t.block is not None and t.kind != "block_input"]
    else:
        drop = [j for j, t in enumerate(step.tensors) if t.kind == "attn_core"]
    redo: dict = {}                       # block -> forward seconds re-run before its backward
    for i, (blk, kind) in enumerate(zip(blocks, kinds)):
        if blk is not None and (full or kind == "attn_core"):
            redo[blk] = redo.get(blk, 0.0) + step.segments[i]
    n_slots = step.n_slots
    first: dict = {}                      # block -> first slot that needs a dropped tensor
    for j in drop:
        t = step.tensors[j]
        if t.first_used_at < n_slots:
            first[t.block] = min(first.get(t.block, n_slots), t.first_used_at)
    segments = list(step.segments)
    for blk, slot in first.items():
        segments[slot] += redo.get(blk, 0.0)
    # Memory, slot by slot: kept tensors from save to the end of their use slot; recomputed ones
    # from their block's recomputation to the end of their own use slot.
    dropped = set(drop)
    live = [0] * (n_slots + 2)
    kept_total = 0
    for j, t in enumerate(step.tensors):
        if j in dropped:
            if t.first_used_at < n_slots:
                live[first[t.block]] += t.nbytes
                live[t.first_used_at + 1] -= t.nbytes
        else:
            kept_total += t.nbytes
            live[step.n_forward] += t.nbytes
            live[min(t.first_used_at, n_slots) + 1] -= t.nbytes
    peak, level = kept_total, 0
    for s in range(step.n_forward, n_slots + 1):
        level += live[s]
        peak = max(peak, level)
    return float(sum(segments)), peak


# ------------------------------------------------------------------------------- hybrid
def hybrid_blocks(step: Step) -> list[Block]:
    """The step's blocks as the hybrid planner sees them: each block's tensors (contiguous in
    save order), its forward time, its input, and selective = re-running its attention core."""
    if not step.has_blocks:
        raise ValueError("hybrid needs a trace with block (layer) structure: analytic traces "
                         "have it, traces recorded by the profiler do not")
    ranges: dict = {}
    for j, t in enumerate(step.tensors):
        if t.block is not None:
            lo, hi = ranges.get(t.block, (j, j))
            ranges[t.block] = (min(lo, j), max(hi, j))
    kinds = step.segment_kind or [""] * step.n_forward
    out = []
    for blk, (lo, hi) in sorted(ranges.items(), key=lambda kv: kv[1]):
        ts = step.tensors[lo:hi + 1]
        if any(t.block != blk for t in ts):
            raise ValueError(f"block {blk}'s tensors are not contiguous in save order")
        fwd = sum(sec for sec, b in zip(step.segments, step.segment_block) if b == blk)
        core = sum(sec for sec, b, k in zip(step.segments, step.segment_block, kinds)
                   if b == blk and k == "attn_core")
        inp = sum(t.nbytes for t in ts if t.kind == "block_input")
        kept = sum(t.nbytes for t in ts if t.kind not in ("attn_core", "block_input"))
        out.append(Block(lo, hi + 1, fwd, inp, selective_bytes=kept, selective_seconds=core))
    return out


def hybrid_step(step: Step, budget: Optional[int], d2h: float, h2d: float) -> Prediction:
    hp = plan_hybrid(step.profile(d2h, h2d), hybrid_blocks(step), budget)
    # Copies back as the runtime issues them (the guard prefetches as room allows; see above).
    n_f, n_slots = hp.profile.n_forward, hp.profile.n_slots
    eager = {j: n_f for j in hp.swap.move if hp.profile.spans[j].use < n_slots}
    return simulate(hp.profile, Plan(hp.swap.move, eager), budget)

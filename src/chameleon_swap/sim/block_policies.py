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

_NO_BLOCKS = ("{policy} needs a trace with block (layer) structure: this step has no "
              "'segment_block' (and no 'blocks'). Analytic traces carry it; record one with "
              "Chameleon(model=..., trace_dir=...) (or `chameleon-swap trace` with a model), "
              "whose steps carry 'blocks' and 'segment_block'")


def _check_blocks(step: Step, policy: str) -> None:
    if not step.has_blocks:
        raise ValueError(_NO_BLOCKS.format(policy=policy))


def _recorded_recompute(step: Step, policy: str) -> tuple[float, int]:
    """Recomputation on a recorded step's ``blocks``: each block's tensors are dropped; full
    keeps its input and re-runs its forward; selective also keeps what selective checkpointing
    kept and re-runs its measured recompute time. Where selective was not measured on a block
    it is counted as full (an upper bound on time, a lower bound on bytes kept). Traced ``--hf``
    steps carry selective's figures for every block (``hf_trace.to_trace``)."""
    full = policy == "full-recompute"
    n_slots, n_f = step.n_slots, step.n_forward
    segments = list(step.segments)
    live = [0] * (n_slots + 2)
    in_block = [False] * len(step.tensors)
    extra = 0
    for b in step.blocks:
        lo, hi = b["first"], b["end"]
        for j in range(lo, hi):
            in_block[j] = True
        uses = [step.tensors[j].first_used_at for j in range(lo, hi)
                if step.tensors[j].first_used_at < n_slots]
        fwd = b.get("forward_seconds")
        fwd = float(sum(step.segments[lo:hi])) if fwd is None else float(fwd)
        kept = b["input_bytes"]
        redo = fwd
        if not full and b.get("selective_bytes") is not None:
            kept += b["selective_bytes"]
            if b.get("selective_seconds") is not None:
                redo = float(b["selective_seconds"])
        if not uses:
            continue
        first = min(uses)
        segments[first] += redo
        # Held from the forward until the block's backward begins; there the recompute (which
        # reuses what was kept) re-creates every tensor the block saved, counted below.
        extra += kept
        live[n_f] += kept
        live[first] -= kept
        for j in range(lo, hi):        # recomputed just before the block's backward
            t = step.tensors[j]
            if t.first_used_at < n_slots:
                live[first] += t.nbytes
                live[t.first_used_at + 1] -= t.nbytes
    kept_total = extra
    for j, t in enumerate(step.tensors):
        if not in_block[j]:
            kept_total += t.nbytes
            live[n_f] += t.nbytes
            live[min(t.first_used_at, n_slots) + 1] -= t.nbytes
    peak, level = kept_total, 0
    for s in range(n_f, n_slots + 1):
        level += live[s]
        peak = max(peak, level)
    return float(sum(segments)), peak


# ------------------------------------------------------------------------------- recomputation
def recompute_step(step: Step, policy: str) -> tuple[float, int]:
    """``full-recompute`` or ``selective-recompute`` on one step: (step seconds, peak bytes)."""
    _check_blocks(step, policy)
    if step.blocks:
        return _recorded_recompute(step, policy)
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
    _check_blocks(step, "hybrid")
    if step.blocks:
        out = []
        for b in step.blocks:
            fwd = b.get("forward_seconds")
            fwd = float(sum(step.segments[b["first"]:b["end"]])) if fwd is None else float(fwd)
            out.append(Block(b["first"], b["end"], fwd, b["input_bytes"],
                             selective_bytes=b.get("selective_bytes"),
                             selective_seconds=b.get("selective_seconds")))
        return out
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

"""A mix's timeline: the keep view of a step with each block run in its mode (keep, selective or
full recomputation). Pure (standard library only), like ``timeline``; ``modes`` searches the mixes.

``apply_modes`` turns the keep view (the step as measured with every block kept) into the
timeline of a mix:

* keep: unchanged.
* full: the block's spans are gone; one movable span of its input bytes is saved where the block
  began and needed where its backward begins; its forward slots take its recompute's time where
  it was measured below its kept forward (``kept_seconds``: a kept block's saves go through the
  engine's hooks, a recomputed one's through checkpoint's); the slot where its backward begins
  gains the block's forward time (the recompute) and, from then until the block's backward ends,
  the block's saved bytes beyond its inputs are held (``reserve``): the recompute re-creates
  them, and saves its inputs (which its first operations save when kept) again in place.
* selective: the same, except that the recompute costs the measured selective time and the bytes
  selective checkpointing keeps (matmul and attention outputs) are held from the block's first
  save until its backward begins, where they become part of the held working set.

``span_origins`` says which keep-view span each of the mix's spans is: a mix's swap plan, made on
its timeline, names the keep view's tensors, which the runtime finds again by their keys while
the mix runs its first steps (before a step of the mix was profiled and planned itself).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .timeline import Profile, Span

if TYPE_CHECKING:                     # (modes imports this module)
    from .modes import Block

MODES = ("keep", "selective", "full")


def own_spans(profile: Profile, block: Block) -> tuple[list[int], int]:
    """The spans a recompute of ``block`` re-creates, and the slot where its backward begins.

    Its backward begins where backward first needs the last tensor it saved (reverse order).
    A tensor it saved first but that backward needs before that is shared with later blocks
    (rotary tables, masks): those still need it, so it is not the block's own and stays a span
    whatever the block's mode."""
    n_slots = profile.n_slots
    inner = range(block.first_span, block.end_span)
    begin = next((profile.spans[j].use for j in reversed(inner)
                  if profile.spans[j].use < n_slots), n_slots)
    return [j for j in inner if profile.spans[j].use >= begin], begin


def working_set(profile: Profile, block: Block) -> int:
    """Bytes the block's recompute re-creates for its backward: what it saves when kept."""
    return sum(profile.spans[j].nbytes for j in own_spans(profile, block)[0])


def apply_modes(profile: Profile, blocks: Sequence[Block], modes: Sequence[str]) -> Profile:
    """The timeline of ``profile`` (the keep view) with each block run in its mode."""
    return _apply(profile, blocks, modes)[0]


def _apply(profile: Profile, blocks: Sequence[Block], modes: Sequence[str]) -> tuple:
    if len(modes) != len(blocks):
        raise ValueError(f"modes has {len(modes)} entries for {len(blocks)} blocks")
    n_slots = profile.n_slots
    compute = list(profile.compute)
    reserve = list(profile.reserve or (0,) * n_slots)
    drop: set[int] = set()
    added: list[tuple[int, int, Span]] = []        # (save slot, order, span) of block inputs
    for b, (blk, mode) in enumerate(zip(blocks, modes)):
        if mode not in MODES:
            raise ValueError(f"mode of block {b} must be one of {MODES}; got {mode!r}")
        if mode == "keep" or not blk.eligible or blk.first_span == blk.end_span:
            continue
        if mode == "selective" and not blk.selective_known:
            raise ValueError(f"block {b} has no measured selective figures")
        own, begin = own_spans(profile, blk)
        if begin >= n_slots:
            continue                                  # never needed again: nothing to recompute
        spans = [profile.spans[j] for j in own]
        drop.update(own)
        first_save = min(sp.save for sp in spans)
        end = max(sp.use for sp in spans if sp.use < n_slots)   # the block's backward, in slots
        added.append((first_save, b, Span(blk.input_bytes, first_save, begin)))
        held = sum(sp.nbytes for sp in spans)
        if blk.kept_seconds and 0 < blk.forward_seconds < blk.kept_seconds:
            # Run under checkpoint, its forward saves nothing through the engine's hooks: it
            # takes what its recompute does, not what it took kept.
            f = blk.forward_seconds / blk.kept_seconds
            for s in range(blk.first_span + 1, min(blk.end_span, profile.n_forward) + 1):
                compute[s] *= f
        if mode == "full":
            compute[begin] += blk.forward_seconds
        else:
            compute[begin] += blk.selective_seconds
            for s in range(first_save, begin):     # from then on, part of the working set
                reserve[s] += blk.selective_bytes
        for s in range(begin, end + 1):      # the recompute saves its inputs again in place
            reserve[s] += max(0, held - blk.input_bytes)
    kept = [(sp.save, -1, j, sp) for j, sp in enumerate(profile.spans) if j not in drop]
    ins = [(save, b, -1, sp) for save, b, sp in added]
    order = sorted(kept + ins, key=lambda x: x[:3])
    return Profile(compute=tuple(compute), n_forward=profile.n_forward,
                   spans=tuple(sp for *_, sp in order),
                   d2h_bytes_per_s=profile.d2h_bytes_per_s,
                   h2d_bytes_per_s=profile.h2d_bytes_per_s,
                   reserve=tuple(reserve) if any(reserve) else (),
                   move_seconds=profile.move_seconds), tuple(j for _, _, j, _ in order)


def span_origins(profile: Profile, blocks: Sequence[Block], modes: Sequence[str]) -> tuple:
    """Per span of ``apply_modes(profile, blocks, modes)``, the index of the keep view's span it
    is, or -1 for the input span of a recomputed block (a tensor the keep view never saved: the
    runtime's recompute saves it, under a key of its own)."""
    return _apply(profile, blocks, modes)[1]

"""Keep views: a step as it runs with every block kept, the input of the block-mode planner
(``planning.modes``), and what timed steps teach about it (policy side, used by
``block_modes.BlockModes``).

A keep view is measured on a timed step that ran every block kept (the very first step with
``model=`` does): its timeline and, per block, the spans it saved, its forward time without the
waits and moves inside it (``block_compute``) and its input bytes. Another size is planned on
the nearest view scaled to it (``scaled``).

A view measured once is not believed forever. The first step runs slow (cold allocations, the
host arena filling): measured on a 4-block HF Llama at a 25% budget on the emulated link, its
backward took 1.2-1.7x that of later steps and its forward 1.1-1.2x. Planned from it, copies
look hidden behind a backward that is not that long, and keeping looks cheaper than it runs. So
timed steps in another mix check the view (``corrected``): their forward, and their backward
without its recomputes (timed apart by the recompute runner; ``timed_compute``), against the
view's scaled to the step's size; beyond ``MISS`` the size gets a corrected view of its own. The
first such step corrects at once, later ones by the median of the last three (``settled``).

On CUDA the first step can be far slower than that: its host arena pins memory while it runs,
and the pinning holds up the step's kernel launches even from a background thread, so the
device-timed slots read the gaps as compute. On an H100 (4096x8 HF Llama, 25% budget) the first
step read 11-16 s for a 0.3 s step, and a view corrected by at most ``CORRECTION_CLAMP`` a step
took five visits of its size to come down, each planning from figures 2-30x off (and ratios
measured against them, like selective's, were off by as much the other way). So views learnt
on the engine's first step are *cold*: the first timed step after it (another mix, or a second
all-kept step) gives the factors by which the cold view it would plan from is off, forward and
backward apart, unclamped, and every cold view is corrected by them (``thaw``): the first
step's slowness is the step's, not its size's.

Its blocks' forward times are timed apart from its slots (``block_compute``), and the first
step's slow time need not fall in both alike: where it falls in slots outside the blocks, the
slots' factor shrinks the blocks by as much. On an H100 (the same Llama at 50%) every recompute
measured against a thawed first-step view read 16x its forward (the clamp) and selective's
12.6x, where the recomputes ran at about their forward's time, and the size kept every block for
the rest of the run: 1.38x the plain step where selective ran 1.12x. A first view whose first
fifth of forward slots read 100x reproduces both figures on the CPU (that run kept no trace to
tell the H100's own skew). So where the blocks' own factor (the timed step's forward of the
same blocks, ``forwards``) is more than ``SPLIT_TRUSTED`` off the slots', the blocks take their
own.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ..planning.modes import Block, working_set
from ..planning.timeline import Profile, Span
from .checks import MISS     # a view off a timed step by more than this is corrected

CORRECTION_CLAMP = (0.5, 2.0)       # a correction beyond these is not believed
TIMED_KEPT = 3                      # timed steps per size whose median corrects its view
# A full recompute against its kept forward, believed within (the sums' ratio, ``full_ratio``:
# 1.1-1.2 on the H100, 0.7-1.3 on the CPU). The bound was 2 while the ratio was a mean of each
# block's, whose outliers it cut; it also held a truly slow recompute (a test's blocks that
# sleep 40 ms in theirs, about 11x their forward) at 2, then at 4: all full was predicted at
# half what it ran, the mixes that ran calibrated every other by that miss (keeping every block
# included, which recomputes nothing), and in a run of several the size recomputed for good.
# A spike is the median's business (``BlockModes._learn_full``), not the bound's.
FULL_RATIO_CLAMP = (0.25, 16.0)
SPLIT_TRUSTED = 2.0     # a cold view's blocks scale as its slots do, unless their own factor is
                        # this far off it either way (``thaw``); on the CPU a kept forward runs
                        # 1.4x a checkpointed one (hooks), within it
OWN_FORWARD_FLOOR = 0.5     # a ratio's denominator: a block's forward in its view is not
                            # believed below this share of what the step itself timed it at


@dataclass
class KeepView:
    profile: Profile            # timeline at the bandwidths of when it was measured
    blocks: list[Block]         # in call order
    block_ids: list[int]        # runner block index of each
    input_bytes: int            # the first block's input: the size the view was measured at
    cold: bool = False          # learnt on the engine's first step (see ``thaw``)
    fixed: tuple = ()           # per span: a parameter's copy, its size the same at every
                                # length (``Views.param_shapes``; empty: none known)
    keys: tuple = ()            # per span: its tensor's key (``TensorKey``; empty: unknown), by
                                # which a mix's swap plan finds its tensors (``mode_entry``)


class Views(dict):
    """Keep views by step size, with a ``version`` that every view set in it moves on and, per
    size, the version its view was set at (``stamps``: a plan records the stamp of the view it
    was made from, ``SizePlans.view_stamp``, checked by ``checks.check_step``), and the shapes
    of the model's parameters of two or more dimensions, each also reversed (``param_shapes``,
    set by the engine): a saved tensor of such a shape is a copy of a parameter (autocast saves
    its casts of the weights, a linear layer's transposed), the same size at every sequence
    length, as is a scalar (see ``scaled``)."""
    version = 0
    param_shapes: frozenset = frozenset()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stamps: dict = dict.fromkeys(self, 0)

    def __setitem__(self, key, view) -> None:
        super().__setitem__(key, view)
        self.version += 1
        self.stamps[key] = self.version

    def near(self, input_bytes: int):
        """The size whose view is nearest ``input_bytes`` (the larger on a tie; None: none)."""
        if not self:
            return None
        return min(self, key=lambda k: (abs(self[k].input_bytes - input_bytes),
                                        -self[k].input_bytes))

    def warm(self) -> None:
        """Every view taken as warm (``cold`` off)."""
        for k, v in self.items():
            self[k] = replace(v, cold=False)


def learn(profile, calls: list, d2h: float, h2d: float, eligible: list,
          input_bytes: int, cold: bool = False,
          param_shapes: frozenset = frozenset()) -> KeepView:
    """The keep view of a timed step that ran every block kept (``calls``: each block's first
    call; ``eligible``: per runner block, False where the user's own checkpointing stands;
    ``param_shapes``: ``Views.param_shapes``)."""
    tl = profile.to_timeline(d2h, h2d)
    blocks = [Block(c.first_record, max(c.first_record, c.end_record),
                    block_compute(profile, c), c.input_bytes,
                    eligible=c.block >= len(eligible) or eligible[c.block])
              for c in calls]
    keyed = len(profile.keys) == len(tl.spans)
    fixed = (tuple(not k.shape or tuple(k.shape) in param_shapes for k in profile.keys)
             if param_shapes and keyed else ())
    return KeepView(tl, blocks, [c.block for c in calls], input_bytes, cold, fixed,
                    tuple(profile.keys) if keyed else ())


def block_compute(profile, call) -> float:
    """A block call's forward time without the waits for copies inside it, nor (where the
    profile keeps them apart, on the CPU) the host time its moves took: a wait or move that
    follows the save of record ``i`` falls in slot ``i + 1``, so the call's own are those of
    slots ``first_record + 1 .. end_record``."""
    sec = call.forward_seconds or 0.0
    inside = slice(call.first_record + 1, call.end_record + 1)
    waits = getattr(profile, "waits", None)
    if waits:
        sec -= sum(waits[inside])
    if getattr(profile, "moves_apart", False):
        sec -= sum(profile.moves[inside])
    return max(0.0, sec)


def timed_compute(profile, calls: list) -> Optional[tuple[float, float]]:
    """(forward, backward without its recomputes) of a timed step (``calls``: the blocks'
    first calls, their recompute times timed apart by the recompute runner); None when the step
    cannot tell."""
    nf = profile.n_forward
    recompute = sum(c.recompute_seconds or 0.0 for c in calls if c.mode != "keep")
    m_fwd = sum(profile.compute[:nf + 1])
    m_bwd = sum(profile.compute[nf + 1:]) - recompute
    return (m_fwd, m_bwd) if min(m_fwd, m_bwd) > 0 else None


def off_by(view: KeepView, measured: tuple[float, float],
           input_bytes: int) -> Optional[tuple[float, float]]:
    """Measured over ``view``'s compute scaled to ``input_bytes``, forward and backward apart
    (unclamped); None where either side has none."""
    f = input_bytes / max(1, view.input_bytes)
    vp, n = view.profile, view.profile.n_forward
    fwd, bwd = f * sum(vp.compute[:n + 1]), f * sum(vp.compute[n + 1:])
    m_fwd, m_bwd = measured
    if min(fwd, bwd, m_fwd, m_bwd) <= 0:
        return None
    return m_fwd / fwd, m_bwd / bwd


def corrected(view: KeepView, measured: tuple[float, float], input_bytes: int,
              own: bool = True) -> Optional[KeepView]:
    """``view`` at the size of ``input_bytes`` with its forward and backward compute set to the
    ``measured`` ones (``timed_compute`` of steps in another mix); None when the view is within
    ``MISS`` of them both ways and is the size's ``own``. Another size's view within ``MISS`` is
    returned scaled, its compute as it is: the timed step confirmed it, and the size plans from
    it as its own from then on (else it runs the plans made from a scaled view, which move
    nothing, for good: on the emulated-link benchmark at 50%, 384 tokens ran such a plan on all
    of its 12 visits, 1.21x the plain step where swapping alone ran 1.17x)."""
    off = off_by(view, measured, input_bytes)
    if off is None:
        return None
    lo, hi = CORRECTION_CLAMP
    ff, fb = (min(hi, max(lo, x)) for x in off)
    f = input_bytes / max(1, view.input_bytes)
    if abs(ff - 1) <= MISS and abs(fb - 1) <= MISS:
        return None if own else scaled(view, f, input_bytes)
    return scaled(view, f, input_bytes, seconds=(ff * f, fb * f))


def thaw(views: dict, measured: tuple[float, float], input_bytes: int,
         forwards: Optional[dict] = None) -> bool:
    """Correct every cold view in ``views`` (key -> view, changed in place) by the factors a
    warm timed step (``measured``: its forward and backward, ``timed_compute``, at
    ``input_bytes``) says the cold view nearest its size is off by (``off_by``, unclamped);
    False when none is cold or the step cannot tell. The views' blocks take the forward factor
    too, unless the factor of their own (``forwards``: the step's ``own_forwards``; see
    ``blocks_off_by``) is more than ``SPLIT_TRUSTED`` off it either way: then that one."""
    cold = [k for k, v in views.items() if v.cold]
    if not cold:
        return False
    near = min((views[k] for k in cold), key=lambda v: abs(v.input_bytes - input_bytes))
    factors = off_by(near, measured, input_bytes)
    if factors is None:
        return False
    own = blocks_off_by(near, forwards or {}, input_bytes)
    trusted = own is None or 1 / SPLIT_TRUSTED <= factors[0] / own <= SPLIT_TRUSTED
    for k in cold:
        v = views[k]
        views[k] = replace(scaled(v, 1.0, v.input_bytes, seconds=factors,
                                  blocks=None if trusted else own), cold=False)
    return True


def own_forwards(profile, calls: list) -> dict:
    """Block id -> its forward in this timed step (``block_compute``), in whatever mode it ran
    (a recomputed block's forward runs the same operations, without saving); blocks timed at
    zero are left out."""
    return {c.block: s for c in calls if (s := block_compute(profile, c)) > 0}


def blocks_off_by(view: KeepView, forwards: dict, input_bytes: int) -> Optional[float]:
    """A step's forward of the view's blocks (``forwards``, ``own_forwards``, at
    ``input_bytes``) over the view's of the same blocks scaled to that size, as sums; None
    where they share no block timed on both sides."""
    f = input_bytes / max(1, view.input_bytes)
    got = [(forwards[i], b.forward_seconds * f) for i, b in zip(view.block_ids, view.blocks)
           if forwards.get(i, 0) > 0 and b.forward_seconds > 0]
    return sum(m for m, _ in got) / sum(v for _, v in got) if got else None


def settled(timed: list, new: tuple[float, float]) -> Optional[tuple[float, float]]:
    """What a size's timed steps in other mixes say its compute is, once ``new`` (a step's
    ``timed_compute``) joins ``timed`` (the size's last ones, oldest first; kept to
    ``TIMED_KEPT``): the first alone (it corrects the slow first step at once), then nothing
    until three, then the median of the last three, forward and backward apart. One step's time
    varies by 10-30% on a shared CPU: corrected on every step, the demo's 8-block Llama made a
    50-150 ms mode plan every few steps for the mix it ran already."""
    timed.append(new)
    del timed[:-TIMED_KEPT]
    if len(timed) == 1:
        return new
    if len(timed) < TIMED_KEPT:
        return None
    return tuple(sorted(t[i] for t in timed)[len(timed) // 2] for i in (0, 1))


def scaled(view: KeepView, f: float, input_bytes: int, seconds=None,
           blocks: Optional[float] = None) -> KeepView:
    """The keep view of another size: bytes and times in proportion (attention's quadratic part
    is not modelled; the guard covers the difference), but for the spans that copy a parameter
    (``KeepView.fixed``), which keep their size. ``seconds`` scales times alone (a compute
    correction), default ``f``; a pair scales forward and backward apart. ``blocks`` scales the
    blocks' forward times instead of the forward's factor (``thaw``).

    Why the fixed spans: on an H100, HF Llama 4096x8 under bf16 autocast saved 18.6 GiB at 8k
    tokens and 33.9 GiB at 16k, 3.3 GiB of it (74 of 243 tensors) the weights' casts at both;
    in proportion, 8k's view read 37.2 GiB at 16k, and at a 75% budget its mode plan recomputed
    a block that the 16k step's own view keeps (the engine's traces in tests/fixtures)."""
    tf, tb = (f, f) if seconds is None else (
        seconds if isinstance(seconds, tuple) else (seconds, seconds))
    p = view.profile
    n = p.n_forward
    fixed = view.fixed or (False,) * len(p.spans)
    spans = tuple(Span(sp.nbytes if keep else int(sp.nbytes * f), sp.save, sp.use, sp.movable)
                  for sp, keep in zip(p.spans, fixed))
    compute = tuple(c * (tf if s <= n else tb) for s, c in enumerate(p.compute))
    prof = replace(p, compute=compute, spans=spans,
                   reserve=tuple(int(r * f) for r in p.reserve))
    fb = tf if blocks is None else blocks
    blks = [replace(b, forward_seconds=b.forward_seconds * fb,
                    input_bytes=int(b.input_bytes * f)) for b in view.blocks]
    return KeepView(prof, blks, view.block_ids, input_bytes, view.cold, view.fixed, view.keys)


def full_ratio(view: Optional[KeepView], calls: list, input_bytes: int,
               own: Optional[dict] = None) -> Optional[float]:
    """What this step's full recomputes took against the view's forward time of the same
    blocks (their sums, clamped; None without one). The view's forward carries the engine's
    saved-tensor hooks (one call per saved tensor), a recompute runs under checkpoint's
    instead: measured on a 4-block HF Llama on this project's CPU, kept forwards read 21-23 ms
    a block, which a step of full recomputation repeated in about 15 ms; planned from the kept
    figure, the all-full mix looked 40% dearer than it ran. None from no view, or a cold one.

    A ratio of sums, not a mean of each block's ratio: a view's split of the forward among its
    blocks is the least sure of its figures (a block that waited has its waits taken out, a
    view scaled from another size scales them alike), and one block's share read small makes
    its ratio large. On an H100 (HF Llama 4096x8, 25%) the mean sat at the 2.0 clamp over 18
    steps while the recomputes summed to 1.1-1.2x the views' forwards, and the all-full mix was
    predicted 0.43 s where it ran 0.32 s.

    ``own``: the step's ``own_forwards``; a block's forward in the view is not believed below
    ``OWN_FORWARD_FLOOR`` of it (``_believed``)."""
    if view is None or view.cold:
        return None
    scale = input_bytes / max(1, view.input_bytes)
    rec = fwd = 0.0
    for c in calls:
        if c.mode != "full" or not c.recompute_seconds or c.block not in view.block_ids:
            continue
        f = _believed(view.blocks[view.block_ids.index(c.block)].forward_seconds * scale,
                      c.block, own)
        if f > 0:
            rec, fwd = rec + c.recompute_seconds, fwd + f
    if not fwd:
        return None
    return min(FULL_RATIO_CLAMP[1], max(FULL_RATIO_CLAMP[0], rec / fwd))


def selective_ratios(view: Optional[KeepView], call, input_bytes: int,
                     own: Optional[dict] = None) -> Optional[tuple]:
    """(bytes, seconds) of a block's selective recompute (``call``, run selective once)
    against what the view says it saves kept and takes forward (``own``: as ``full_ratio``'s);
    None if it cannot tell (no view, or a cold one)."""
    if view is None or view.cold or call.block not in view.block_ids or not call.recompute_seconds:
        return None
    blk = view.blocks[view.block_ids.index(call.block)]
    scale = input_bytes / max(1, view.input_bytes)
    kept = working_set(view.profile, blk) * scale
    fwd = _believed(blk.forward_seconds * scale, call.block, own)
    if kept <= 0 or fwd <= 0:
        return None
    return call.selective_bytes / kept, call.recompute_seconds / fwd


def _believed(forward: float, block: int, own: Optional[dict]) -> float:
    """A view's forward of ``block`` (scaled to the step), raised to ``OWN_FORWARD_FLOOR`` of
    the step's own timing of it where that is more: a recompute repeats the forward its step
    timed, and a view whose blocks read a sixteenth of it (a cold view's, see the module's
    docstring) made every recompute look 16x its forward. On the CPU the view's kept forward
    reads above the checkpointed one (hooks), and the floor stays below it."""
    return max(forward, OWN_FORWARD_FLOOR * (own or {}).get(block, 0.0))


def with_ratios(prof: Profile, blk: Block, sel_bytes: Optional[float],
                sel_seconds: Optional[float], full: Optional[float]) -> Block:
    """The block with what its recomputes were measured to cost, as ratios of its keep-view
    figures (None: not measured): selective's held bytes and recompute time, and a full
    recompute's time (``forward_seconds`` is what a full recompute repeats, ``kept_seconds``
    the kept forward)."""
    if sel_bytes is not None:
        kept = working_set(prof, blk)
        blk = replace(blk, selective_bytes=int(kept * sel_bytes),
                      selective_seconds=blk.forward_seconds * sel_seconds)
    if full is not None:
        blk = replace(blk, forward_seconds=blk.forward_seconds * full,
                      kept_seconds=blk.forward_seconds)
    return blk

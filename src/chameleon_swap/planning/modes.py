"""Block modes: which blocks to keep, recompute selectively or recompute fully, chosen together
with the swap set. Pure (standard library only), like ``timeline`` and ``planner``.

Why one decision: on an H100 the host link moves about 54 GB/s each way, so at a 25% budget a
Llama step must copy ~25 GB out and back while its forward pass, which must hide the copies out,
takes ~0.15 s: swapping alone stalls for seconds, while full recomputation costs 1.14-1.20x of the
plain step (measured by the project on an H100 with Hugging Face Llama models, bf16 autocast).
Swapping is worth it for the bytes the link can hide; beyond that, recomputing is cheaper than
waiting, and keeping is free while it fits.

The input is the *keep view* of a step: its timeline ``Profile`` as measured with every block
kept, and per block (``Block``) the spans it saved, its forward time, the bytes of its inputs and,
where measured, what selective checkpointing keeps and costs. ``mix_view.apply_modes`` turns the
keep view into the timeline of a mix of modes (and ``span_origins`` says which of its spans is
which of the keep view's: the runtime applies a mix's swap set by the keep view's tensor keys).

``plan_hybrid`` searches families of mixes (blocks converted in order of the shortest wait between
their forward and their backward, since those are the ones the link cannot hide), then climbs
from the best mix found (``_ModeSearch.climb``, off by default), runs the swap planner on each
(a rough plan, ``ROUGH_EVALS`` simulations; the best ``REFINED`` mixes are then planned with
``QUICK_EVALS``; a family whose two ends are far slower than the best so far is skipped) and
keeps the least predicted time under the budget. The uniform mixes (swap only,
all selective where measured, all full) are always among the candidates, so the result is never
predicted slower than any of them (as the search plans their swaps) where it fits. When no mix
fits, the one with the smallest peak is chosen (the policy then warns), never all kept.

A model is a model: mixes it ranks close can run far apart (4-block HF Llama, 25%, emulated link:
one block kept and three recomputed, predicted within 5% of all four, ran 10-15% slower). So a mix
that ran at this size is ranked by the step time it ran at (``measured``) and is always a candidate;
two or more that ran calibrate those that did not (the least ratio of measured over predicted among
them; for a mix that copies or selects, among those that did: ``calibration``). The mix a size runs
(``incumbent``) stays unless another is ``SWITCH_GAIN`` faster, or it copies or recomputes
selectively and ran that much above its own prediction beyond what the quiet mixes that ran there
missed by (a quiet mix's miss is the compute's, every mix's alike: the emulated-link benchmark at
50% left (2, 0, 2), 0.165-0.168 s, for (2, 2, 0) predicted 0.154 s, ran 0.23); a quiet one that does
no more work than the best stays whatever it ran (``dominates``). The model's parts most often wrong
are the link and what a mix holds (an 8-block HF Llama on the emulated link: keep 5, recompute 3,
predicted 53 ms, ran 62; all full predicted 60, ran 54; a 4-block one at 50%: all selective
predicted to fit, the guard moved 7.6 MiB, it ran 1.7x of the plain step, PyTorch's selective
1.09x). So the best other mix scored of those the model is surest of (kept and fully recomputed
blocks, next to nothing moved: ``calibration.light``) that fits and never ran comes with the winner
(``HybridPlan.fallback``), for the policy to run beside it.

Host memory is bounded too (``host_limit``: the room of the host arena, ``host_memory_limit``):
every byte a plan copies out holds a host buffer until backward releases its tensor, so a mix
whose predicted copies (``moved_bytes``) exceed it would fail the step. Such mixes rank after
every mix within host room, the least over first: the search recomputes more instead. When no
mix keeps its copies within host room, the one that moves least is chosen (the policy warns).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Collection, Mapping, Optional, Sequence

from .calibration import CALIBRATION_CLAMP, calibrations, dominates, level, light, moving
from .ladder import best_count
from .mix_view import MODES, apply_modes, own_spans, span_origins, working_set
from .swaps import plan as plan_swaps
from .timeline import Plan, Prediction, Profile, unmoved_peak

SWITCH_GAIN = 0.10               # leave a mix for one this much faster only (5% switched on noise)
ROUGH_EVALS = 12          # swap-planner simulations per mix while the search ranks mixes,
REFINED = 2               # then this many of the best are planned again with QUICK_EVALS
HOPELESS = 0.10           # a family whose ends are this much slower than the best is skipped
QUICK_EVALS = 48          # a careful plan's simulations (24 found no swap set fitting a
                          # 4-block Llama's full mix, and the search kept everything)
CLIMB_PASSES = 0          # steps of the climb from the families' best: off (see climb)


@dataclass(frozen=True)
class Block:
    first_span: int                    # spans [first_span, end_span) are saved inside the block
    end_span: int                      #   when it is kept
    forward_seconds: float             # its forward compute: what full recomputation repeats
    input_bytes: int                   # what full recomputation saves instead (its inputs)
    selective_bytes: Optional[int] = None      # kept by selective checkpointing (None: unknown)
    selective_seconds: Optional[float] = None  # recompute time of selective (None: unknown)
    eligible: bool = True              # False: left as the user wrote it (always keep)
    kept_seconds: Optional[float] = None   # its kept forward, where above forward_seconds

    def __post_init__(self) -> None:
        if not 0 <= self.first_span <= self.end_span:
            raise ValueError(f"block spans [{self.first_span}, {self.end_span}) are not a range")
        if self.forward_seconds < 0 or self.input_bytes < 0:
            raise ValueError("forward_seconds and input_bytes must be >= 0")

    @property
    def selective_known(self) -> bool:
        return self.selective_bytes is not None and self.selective_seconds is not None


@dataclass(frozen=True)
class HybridPlan:
    modes: tuple[str, ...]             # per block
    profile: Profile                   # the step's timeline under these modes
    swap: Plan                         # the swap plan over ``profile`` (predicted filled in)
    working_set: tuple[int, ...]       # per block: bytes held while its recompute + backward run
    fallback: Optional["HybridPlan"] = None   # see plan_hybrid
    recompute_seconds: float = 0.0     # of its recomputes, in ``profile`` (checked apart)
    origins: tuple[int, ...] = ()      # per span of ``profile``: the keep view's (span_origins)

    @property
    def predicted(self) -> Prediction:
        return self.swap.predicted

    def counts(self) -> tuple[int, int, int]:
        """How many blocks keep, recompute selectively, recompute fully."""
        return tuple(self.modes.count(m) for m in MODES)


def conversion_order(profile: Profile, blocks: Sequence[Block]) -> list[int]:
    """Blocks that can be recomputed, those whose activations wait the least first: the time
    from the end of their forward to the start of their backward is the window the link has to
    hide their copies, so the blocks with short windows are the ones to recompute (or keep)."""
    st = profile.starts
    n_slots = profile.n_slots
    keyed = []
    for b, blk in enumerate(blocks):
        if not blk.eligible or blk.first_span == blk.end_span:
            continue
        own, begin = own_spans(profile, blk)
        if begin >= n_slots:
            continue
        last_save = max(profile.spans[j].save for j in own)
        keyed.append((st[begin] - st[last_save + 1], -b, b))
    return [b for *_, b in sorted(keyed)]


def full_recompute_modes(blocks: Sequence[Block]) -> tuple[str, ...]:
    return tuple("full" if blk.eligible else "keep" for blk in blocks)


def plan_hybrid(profile: Profile, blocks: Sequence[Block], budget: Optional[int], *,
                max_evals: Optional[int] = None, host_limit: Optional[int] = None,
                measured: Optional[Mapping[tuple, float]] = None,
                incumbent: Optional[tuple] = None,
                held: Optional[Collection[tuple]] = None) -> HybridPlan:
    """Block modes and swap set with the least predicted step time under ``budget``, copying out at
    most ``host_limit`` bytes where any mix can (None: host memory is not bounded).

    Nothing is recomputed or moved when the keep view's unmoved peak fits. ``max_evals`` bounds
    the swap planner's simulations for the final plan (its default otherwise). ``measured``:
    step seconds that mixes (modes per block) were measured to run at this size; such a mix is
    ranked by what it ran, not by what the model predicts of it, and is always a candidate.
    ``held``: those of them that ran under a budget no larger than ``budget`` (None: all), which
    fit it as they ran (``_ModeSearch.key``).
    ``incumbent``: the mix the size runs now; it stays unless another is ``SWITCH_GAIN`` faster
    (a new mix costs steps of its own: its first swap plans are the guard's and made from
    estimates). The winner carries a ``fallback`` where the search scored another mix that moves
    next to nothing, recomputes nothing selectively and fits (module docstring)."""
    keep = tuple("keep" for _ in blocks)
    if budget is None or unmoved_peak(profile) <= budget:
        return _made(profile, blocks, keep, plan_swaps(profile, budget))   # (moves nothing)
    blocks = recomputable(profile, blocks, budget)
    search = _ModeSearch(profile, blocks, budget, host_limit, measured, held)
    best = search.run(incumbent)
    # The search compared quick swap plans, the three uniform mixes (swap only, all selective
    # where measured, all full) always among them, so the winner's is never above theirs where
    # they fit. The winner is then planned in full, kept only if that is better still.
    final = plan_swaps(search.view(best), budget, max_evals=max_evals)
    quick = search.plans[best]
    better = search.key(final.predicted, best) <= search.key(quick.predicted, best)
    swap = final if better else quick
    made = _made(search.view(best), blocks, best, swap, profile)
    lit = (min(profile.d2h_bytes_per_s, profile.h2d_bytes_per_s),     # (all full moves what
           search._plan(full_recompute_modes(blocks)).predicted.moved_bytes)  # no mix avoids)
    quiet = [m for m, p in search.plans.items() if m != best and m not in search.measured
             and light(m, p.predicted, *lit) and search.key(p.predicted, m)[:3] == (0, False, 0)]
    if quiet:
        fb = min(quiet, key=lambda m: (search.score(m), m))
        fallback = _made(search.view(fb), blocks, fb, search.plans[fb], profile)
        made = replace(made, fallback=fallback)
    return made


def recomputable(profile: Profile, blocks: Sequence[Block], budget: int) -> list[Block]:
    """``blocks``, those whose recompute with its inputs holds more than ``budget`` made
    ineligible: such a block cannot recompute within it, and the runtime runs it keep
    (``BlockModes.mode``), so the searches do too."""
    return [replace(b, eligible=False) if b.eligible and working_set(profile, b) > budget
            else b for b in blocks]


def _made(view: Profile, blocks, modes, swap: Plan, keep_view: Optional[Profile] = None):
    base = keep_view if keep_view is not None else view
    ws = tuple(working_set(base, blk) if m != "keep" and blk.eligible else 0
               for blk, m in zip(blocks, modes))
    rec = sum(b.forward_seconds if m == "full" else b.selective_seconds for b, m, w in
              zip(blocks, modes, ws) if w)
    origins = (span_origins(keep_view, blocks, modes) if keep_view is not None
               else tuple(range(len(view.spans))))
    return HybridPlan(tuple(modes), view, swap, ws, recompute_seconds=rec, origins=origins)


class _ModeSearch:
    """Families of mixes along the conversion order, each searched on how many blocks convert:
    all full, all selective (where measured), and full for the first blocks with selective for
    the rest. A geometric ladder, then a ternary search around the best rung."""

    def __init__(self, profile: Profile, blocks: Sequence[Block], budget: int,
                 host_limit: Optional[int] = None,
                 measured: Optional[Mapping[tuple, float]] = None,
                 held: Optional[Collection[tuple]] = None) -> None:
        self.pr, self.blocks, self.budget, self.host_limit = profile, [*blocks], budget, host_limit
        self.measured = {tuple(m): t for m, t in (measured or {}).items()
                         if t > 0 and self.can_run(m)}
        self.held = set(self.measured) if held is None else {tuple(m) for m in held}
        self.calibration = (1.0, 1.0)   # quiet, moving mixes that did not run (see run)
        self.refined: set = set()
        self.order = conversion_order(profile, blocks)
        self.views: dict[tuple, Profile] = {}
        self.plans: dict[tuple, Plan] = {}
        self.scale = max(float(sum(profile.compute)), 1e-12)

    def can_run(self, modes) -> bool:
        """A mix of these blocks that can run now (recomputed only where eligible, selective
        only where measured)."""
        return len(modes) == len(self.blocks) and all(m == "keep" or (blk.eligible and (
            m == "full" or (m == "selective" and blk.selective_known)))
            for m, blk in zip(modes, self.blocks))

    def view(self, modes: tuple) -> Profile:
        v = self.views.get(modes)
        if v is None:
            v = self.views[modes] = apply_modes(self.pr, self.blocks, modes)
        return v

    def key(self, pred: Prediction, modes: tuple) -> tuple:
        # A mix whose copies fit the host room beats one whose do not (that one would fail the
        # step), the least over first; then a mix that fits the budget beats one that does not;
        # among those that do not, the smallest peak (never quietly everything kept); then the
        # least predicted time. A mix that ran under this budget (or a smaller one: ``held``)
        # fits as it ran: the guard held the budget, and what holding it cost is in the time it
        # ran at. The model's fit is its least sure figure
        # (a non-movable save over the budget hangs on when copies end): a 4-block Llama at
        # 25% ran all full at 0.19 s on a 20 MB/s link, the model read it over the budget, and
        # the size kept every block for good at 1.76 s a step, as predicted.
        host_over = 0 if self.host_limit is None else max(0, pred.moved_bytes - self.host_limit)
        recomputed = sum(m != "keep" for m in modes)
        ran = self.measured.get(modes)
        fits = pred.budget_ok or modes in self.held
        seconds = pred.total_seconds * self.calibration[moving(modes, pred)] if ran is None else ran
        return (host_over, not fits, 0 if fits else pred.peak_bytes, round(seconds / self.scale, 9),
                recomputed, pred.moved_bytes)

    def uniform(self) -> list:
        """The uniform mixes: swap only, all selective (where measured), all full."""
        out = [tuple("keep" for _ in self.blocks)]
        if self.order and all(self.blocks[b].selective_known for b in self.order):
            out.append(tuple("selective" if blk.eligible else "keep" for blk in self.blocks))
        out.append(full_recompute_modes(self.blocks))
        return out

    def _plan(self, modes: tuple) -> Plan:
        p = self.plans.get(modes)
        if p is None:
            p = self.plans[modes] = plan_swaps(self.view(modes), self.budget,
                                               max_evals=ROUGH_EVALS)
        return p

    def refine(self, modes: tuple) -> None:
        """Plan ``modes``'s swaps with ``QUICK_EVALS`` (kept where better than the rough plan)."""
        if modes in self.refined:
            return
        self.refined.add(modes)
        p = plan_swaps(self.view(modes), self.budget, max_evals=QUICK_EVALS)
        if self.key(p.predicted, modes) <= self.score(modes):
            self.plans[modes] = p

    def score(self, modes: tuple) -> tuple:
        return self.key(self._plan(modes).predicted, modes)

    def _hopeless(self, a: tuple, b: tuple, best: tuple) -> bool:
        """Both ends of a family fit no better than the best mix so far, or as well but
        ``HOPELESS`` slower: its search is skipped (the mixes between them are taken to be no
        better than its ends, as the search along a family takes the time to be unimodal)."""
        def far(key: tuple) -> bool:
            return key[:3] > best[:3] or (key[:3] == best[:3] and key[3] > best[3] * (1 + HOPELESS))
        return far(self.score(a)) and far(self.score(b))

    def family(self, first: str, rest: str):
        order, n_blocks = self.order, len(self.blocks)

        def modes(k: int) -> tuple:
            m = ["keep"] * n_blocks
            for i, b in enumerate(order):
                m[b] = first if i < k else rest
            return tuple(m)
        return modes

    def best_k(self, modes, n: int) -> tuple:
        return modes(best_count(lambda k: self.score(modes(k)), n))

    def neighbours(self, modes: tuple) -> list:
        """The mixes one step from ``modes``: one block's mode changed (to one it can run), or
        two neighbouring blocks' modes exchanged."""
        out = []
        for b, blk in enumerate(self.blocks):
            if blk.eligible:
                out += [modes[:b] + (m,) + modes[b + 1:] for m in MODES
                        if m != modes[b] and (m != "selective" or blk.selective_known)]
        for b in range(len(modes) - 1):
            if modes[b] != modes[b + 1] and self.blocks[b].eligible and self.blocks[b + 1].eligible:
                out.append(modes[:b] + (modes[b + 1], modes[b]) + modes[b + 2:])
        return out

    def climb(self, start: tuple) -> tuple:
        """The best of ``start``'s ``neighbours`` where it scores better, and so on, at most
        ``CLIMB_PASSES`` times. The families convert blocks in one order, so a kept block sits
        beside kept ones; the link copies a kept block's saves out while the blocks after it
        run, and a recomputed block between two kept ones (which saves only its inputs) gives it
        that block's forward. On this project's H100 trace (HF Llama 4096x8, 16k tokens, a
        clean profile) at 25% of its peak the families' best kept blocks 0-1, predicted 1.236x
        the plain step (issue 18's target there is 1.20x), where keeping 0, 1 and 3 moves 3.6
        GiB more and is predicted at 1.183x, no stall (0, 1 and 2: 1.283x, 52 ms of stall); on
        the CPU benchmark's keep views at 25% (256x8 at 130 MB/s, 512 tokens) 1.228x -> 1.148x.
        Run there side by side with the search without it (two engines in one process, every
        step over full recomputation's of its round): 0.949x against 0.960x, 0.950x against
        0.987x and 1.023x against 1.024x, inside that machine's noise; at 50% level (0.849x,
        0.850x). Two steps found those mixes (four: 1.147x at
        512 tokens); a step costs about a rough plan per block and mode (a size's plan took
        0.2-0.5 s where it took 0.1-0.3 s). Off (``CLIMB_PASSES = 0``) until a GPU shows the
        model's gain: on the real clock a 4-block HF Llama at 25% on a 50 MB/s emulated link,
        planned again after a miss, went from all full to its last block kept in 10 runs of 15
        (none without the climb), predicted faster, ran 10-20% slower (it moved 1.6 MB where
        all full moved 0.8), and stayed for five steps and more."""
        cur = start
        for _ in range(CLIMB_PASSES):
            best = min(self.neighbours(cur), key=lambda m: (self.score(m), m), default=cur)
            if self.score(best) >= self.score(cur):
                break
            cur = best
        return cur

    def compute_miss(self) -> float:
        """What the compute alone missed by at this size, where it ran slow: the least measured
        over predicted step time of the quiet mixes that ran (1.0 where none did or where that
        is below 1: only ever more loyalty). A moving incumbent's overrun counts beyond it. The
        emulated-link benchmark's 8-block Llama at 25%, 512 tokens: two blocks kept, predicted
        0.820 s, ran 0.906 s and were left on that 10.5% for all full, which ran 0.903 s
        against 0.843 s predicted (7% over); the model put two kept 3% ahead, and forced runs
        of each put them 4% ahead (two kept 0.970x full recomputation's step, all full about
        1.01x). Both had missed alike: by the compute, which every mix shares."""
        ratios = [t / p.total_seconds for m, t in self.measured.items()
                  if not moving(m, p := self._plan(m).predicted) and p.total_seconds > 0]
        return min(CALIBRATION_CLAMP[1], max(1.0, min(ratios))) if ratios else 1.0

    def run(self, incumbent: Optional[tuple] = None) -> tuple:
        # The mixes that ran calibrate those that did not (measured over predicted; else a model
        # reading every mix 10% fast makes each that ran look worse than each that did not). The
        # least ratio: a mix that did not run gets the benefit of the doubt (some ran slow for
        # reasons of their own: a recompute the keep view cannot see). From two on: calibrated
        # by one, the others keep their order behind it, and a slow mix would never be left.
        for m in self.measured:
            self.refine(m)
        # Moving mixes (copies, selective) by the moving ones that ran (``calibration.py``).
        self.calibration = calibrations(
            (moving(m, p.predicted), t / p.predicted.total_seconds)
            for m, t, p in ((m, t, self._plan(m)) for m, t in self.measured.items())
            if p.predicted.total_seconds > 0)
        n = len(self.order)
        cands = [self.best_k(self.family("full", "keep"), n)]
        if n and all(self.blocks[b].selective_known for b in self.order):
            best = self.score(cands[0])
            for first, rest in (("selective", "keep"), ("full", "selective")):
                modes = self.family(first, rest)
                if not self._hopeless(modes(0), modes(n), best):
                    cands.append(self.best_k(modes, n))
        cands += self.uniform()                 # always: swap only, all selective, all full
        cands += list(self.measured)
        cands.append(self.climb(min(cands, key=lambda m: (self.score(m), m))))
        if incumbent is not None and not self.can_run(incumbent):
            incumbent = None                    # it cannot run now: no candidate
        if incumbent is not None:
            cands.append(incumbent)
            self.refine(incumbent)
        # Rough plans ranked the mixes; the best few get careful ones (the better plan is kept).
        cands = sorted(set(cands), key=lambda m: (self.score(m), m))
        for m in cands[:REFINED]:
            self.refine(m)
        best = min(cands[:REFINED], key=lambda m: (self.score(m), m))
        if incumbent is None or incumbent == best:
            return best
        ran, inc = self.measured.get(incumbent), self._plan(incumbent).predicted
        if dominates(incumbent, inc, best, pb := self._plan(best).predicted) or level(
                incumbent, inc, best, pb):
            return incumbent   # no more work than the best, nothing more moved: it stays
        if ran is not None and ran > (1 + SWITCH_GAIN) * self.compute_miss() * inc.total_seconds \
                and moving(incumbent, inc):
            return best       # well above its prediction where the model is least sure: no loyalty
        now, new = self.score(incumbent), self.score(best)
        if now[:3] == new[:3] and new[3] > (1 - SWITCH_GAIN) * now[3]:
            return incumbent             # fits as well, and not clearly slower: it stays
        return best

"""Out of host memory, recompute instead (issue 19, item 3): the run-time half.

The mode plans keep their predicted copies within ``host_memory_limit`` (``BlockModes`` passes
it to ``plan_hybrid``). A step without such a plan (the first one, a size planned from another's
view) or whose plan misjudged its copies would still fail with ``HostMemoryError`` when the host
arena is full. So at each block's start, with ``model=``, the policy asks ``short``: if the
arena's room left is less than the block would need kept, the block runs full instead.

What a block needs kept is learnt from the blocks that ran kept (most bytes saved per byte of
input, a page per saved tensor since host buffers take whole pages): all of it may go to the
host (a plan moves what it likes), and so may the inputs of the blocks after it (if they
recompute), about one block's worth of resident bytes moved out to leave room for a recompute's
working set, and what the step saves after its last block (as the last step did). A heuristic:
it errs on the side of recomputing.

The same question, asked where allocating host memory is slow (pinned, on CUDA), is whether a
step's moves would wait for the arena to grow. On a cold arena every byte the guard moves is
first allocated, pinned at about a GiB a second on the H100 the project measured, where the link
moves tens: the capped schedule's first step there took 44.9 s of the schedule's 59.4 s, its
blocks all kept to measure them and 29.4 GiB moved. So on a step with no plan, a block that,
kept with the blocks after it, would take the step past its budget (what it saves after its
last block and the room kept for a recompute to come included) by more than the arena has free
runs full (``cold``), and the arena is asked for that room in the background
(``HostPool.room``). A block's size is learnt from the blocks that ran kept or, before any did,
counted in a full block's recompute (``BlockCall.kept_bytes``): the engine's first step on a
cold arena runs every block full unless ``UNKNOWN_PER_INPUT`` times their inputs fit. A step
that finds the room keeps every block and teaches the keep view (timed: with model= every step
is until a view exists), as does a size the budget holds whole, which moves nothing. A step with
a plan whose moves (at its size) the arena cannot hold now keeps its blocks only as far as
``cold`` allows, the rest full (``unready``), and reports no prediction. Where allocating is
fast (plain memory on the CPU) the arena always has room, and nothing changes.

Reproduced on the CPU with the arena's testing delay at the H100's ratio of pinning to link
speed (400 s a GiB against the 130 MB/s emulated link), before and after: the capped schedule's
stand-in (``benchmarks/capped.py``) 6.10x the plain steps' total before, 2.22x and 2.50x in
two runs after (its first step 15.3 s, then 0.40-0.49 s, the plain step 0.35 s; after, a
512-token step run full at the budget's edge still waited 3.6-3.7 s for a slab on its way: 16
MiB, 16 ms of pinning on the H100, is seconds at this delay); the emulated-link benchmark's
hybrids (``benchmarks/hybrid.py``, 256x8) took 19.5 s and 12.3 s at 25%, 28.8 s and 10.4 s at
50%, 17.1 s and 9.1 s at 75% in all (the plain steps 7.2-8.2 s), waiting 3.1-15.3 s on first
visits of a size before and never after.
"""
from __future__ import annotations

from typing import Optional

from ..copy.host_pool import ALIGN
from ..planning.timeline import unmoved_peak

# Before any block was measured (kept, or counted in a full block's recompute), what a block is
# taken to save kept, per byte of its input. Measured, with what the step saves after its last
# block spread over the blocks: the emulated-link benchmark's HF Llama 21x on the CPU (85.8 MiB
# over 8 layers of 0.5 MiB inputs at 512 tokens), the tests' model 16x, the GPU benchmark's
# Llama about 15x on the H100 (30.4 GiB over 8 layers at 16k tokens, a 256 MiB fp32 residual
# stream). More errs towards a first step run full, which then tells.
UNKNOWN_PER_INPUT = 32


class HostRoom:
    def __init__(self, ex) -> None:
        self.ex = ex
        self.host_per_input = 0.0       # most host bytes a kept block saved per input byte
        self.saved_per_input = 0.0      # the same in saved bytes (pages not rounded up)
        self.tail_bytes = 0             # saved from the last block's start on, less the block
        self.tail_per_input = 0.0       # the same per byte of the last block's input (a
                                        # Llama's logits grow with the tokens as its inputs do)
        self.recomputes = 0             # blocks run full for host room (all steps)
        self.cold_recomputes = 0        # of those, blocks of a step with no plan (``cold``)
        self._start: Optional[tuple] = None   # (saved bytes, records, mode, input bytes) at
                                              # the start of the last block call

    def block_starts(self) -> None:
        """A block call starts: learn from the one before it."""
        self._learn(last_block=False)

    def started(self, mode: str, input_bytes: int) -> None:
        st = self.ex.stats
        self._start = (st.saved_bytes, self.ex.next_index, mode, input_bytes)

    def end_step(self, profile=None) -> None:
        self._learn(last_block=True)
        for c in getattr(profile, "blocks", None) or ():
            if c.mode == "full" and c.kept_bytes and c.input_bytes:   # counted in its recompute
                self.saved_per_input = max(self.saved_per_input, c.kept_bytes / c.input_bytes)
                self.host_per_input = max(self.host_per_input,
                                          (c.kept_bytes + ALIGN * c.kept_saves) / c.input_bytes)

    def unknown(self) -> bool:
        """Nothing tells yet what a block saves kept: full blocks' recomputes count it."""
        return self.saved_per_input <= 0

    def short(self, b: int, input_bytes: int, modes) -> bool:
        """Whether block ``b`` (of ``modes``' blocks: ``BlockModes``), kept, could run the host
        arena out of room, or make the step wait for it to grow (``cold``)."""
        ex, n_blocks = self.ex, len(modes.eligible)
        if ex.budget is None:
            return False
        pool = ex.pool
        if self.host_per_input <= 0 or pool.limit_bytes - pool.in_use_bytes >= (
                2 * int(self.host_per_input * input_bytes) + self.tail_bytes
                + max(0, n_blocks - b - 1) * (input_bytes + ALIGN)):
            if not self.cold(b, input_bytes, n_blocks, modes):
                return False
        self.recomputes += 1
        return True

    def cold(self, b: int, input_bytes: int, n_blocks: int, modes) -> bool:
        """Whether block ``b``, kept with the blocks after it that the step keeps, would take
        the step past its budget by more host bytes than the arena has free now (see the
        module docstring); if so the arena is asked for them. Asked on a step with no plan,
        and on one whose plan's moves the arena cannot hold now (``unready``). Before any
        block was measured, a block is taken to save up to ``UNKNOWN_PER_INPUT`` times its
        input, and the arena is not asked. Never where the block's recompute alone would not
        fit the budget (its working set is about what it saves kept): kept, it can move."""
        ex, plan = self.ex, modes.plan
        if plan is not None and not self.unready(modes):
            return False
        known = self.saved_per_input > 0
        k = int((self.saved_per_input if known else UNKNOWN_PER_INPUT) * input_bytes)
        if known and k > ex.budget:
            return False
        full = 0 if plan is None else sum(plan.modes.get(j) == "full"
                                          for j in range(b + 1, n_blocks))
        # The step's peak, at forward's end: what it saves after its last block too, and the
        # room kept for the largest recompute to come (``recompute_reserve``: about what a
        # block saves kept, less its inputs)
        reserve = max(modes.ahead(), k - input_bytes if full else 0)
        over = (ex.resident_bytes + k * (n_blocks - b - full) + full * (input_bytes + ALIGN)
                + int(self.tail_per_input * input_bytes) + reserve - ex.budget)
        host = int(over * (self.host_per_input / self.saved_per_input if known else 1.0))
        if over <= 0 or ex.pool.room(host, ask=known):
            return False
        self.cold_recomputes += 1
        return True

    def unready(self, modes) -> bool:
        """Whether the step's plan moves more than the host arena has free now (where
        allocating is slow), asked once a step (``modes.unready``; the arena is asked for the
        room); then its blocks are kept only as far as ``cold`` allows. Measured on the CPU with
        the arena's testing delay at the H100's ratio of pinning to link speed: the
        emulated-link benchmark's 8-block Llama at 75%, its longest size run on a shorter
        size's plan that kept every block (the guard moving 22 MB), waited 4.1-4.8 s for the
        arena to grow on the step's thread."""
        if modes.unready is None:
            hp, scale = modes.plan.hybrid, modes.input_bytes / max(1, modes.plan.input_bytes)
            if hp.predicted is None:
                modes.unready = False
                return False
            # What the mix moves at this size: the plan's moves or, where more, what it holds
            # with nothing moved past the budget (a plan made for another size, scaled)
            held = max(hp.predicted.peak_bytes, unmoved_peak(hp.profile)) * scale
            moved = max(hp.predicted.moved_bytes * scale, held - self.ex.budget)
            modes.unready = moved > 0 and not self.ex.pool.room(int(moved))
        return modes.unready

    def saved_bytes(self, input_bytes: int) -> int:
        """What a block of ``input_bytes`` saves kept: its recompute's working set where no
        plan gives one."""
        return int(self.saved_per_input * input_bytes)

    def _learn(self, last_block: bool) -> None:
        last, self._start = self._start, None
        if last is None:
            return
        raw = self.ex.stats.saved_bytes - last[0]
        saved = raw + ALIGN * (self.ex.next_index - last[1])
        if last_block:
            own = int(self.host_per_input * last[3]) if last[2] == "keep" else 0
            self.tail_bytes = max(0, saved - own)
            self.tail_per_input = self.tail_bytes / last[3] if last[3] > 0 else 0.0
        elif last[2] == "keep" and last[3] > 0:
            self.host_per_input = max(self.host_per_input, saved / last[3])
            self.saved_per_input = max(self.saved_per_input, raw / last[3])

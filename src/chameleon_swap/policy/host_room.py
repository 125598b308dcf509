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
"""
from __future__ import annotations

from typing import Optional

from ..copy.host_pool import ALIGN


class HostRoom:
    def __init__(self, ex) -> None:
        self.ex = ex
        self.host_per_input = 0.0       # most host bytes a kept block saved per input byte
        self.saved_per_input = 0.0      # the same in saved bytes (pages not rounded up)
        self.tail_bytes = 0             # saved from the last block's start on, less the block
        self.recomputes = 0             # blocks run full for host room (all steps)
        self._start: Optional[tuple] = None   # (saved bytes, records, mode, input bytes) at
                                              # the start of the last block call

    def block_starts(self) -> None:
        """A block call starts: learn from the one before it."""
        self._learn(last_block=False)

    def started(self, mode: str, input_bytes: int) -> None:
        st = self.ex.stats
        self._start = (st.saved_bytes, self.ex.next_index, mode, input_bytes)

    def end_step(self) -> None:
        self._learn(last_block=True)

    def short(self, b: int, input_bytes: int, n_blocks: int) -> bool:
        """Whether block ``b`` (of ``n_blocks``), kept, could run the host arena out of room."""
        ex = self.ex
        if ex.budget is None or self.host_per_input <= 0:
            return False
        keep = int(self.host_per_input * input_bytes)
        later = max(0, n_blocks - b - 1) * (input_bytes + ALIGN)
        pool = ex.pool
        if pool.limit_bytes - pool.in_use_bytes >= 2 * keep + later + self.tail_bytes:
            return False
        self.recomputes += 1
        return True

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
        elif last[2] == "keep" and last[3] > 0:
            self.host_per_input = max(self.host_per_input, saved / last[3])
            self.saved_per_input = max(self.saved_per_input, raw / last[3])

"""The project's own GPU traces as test inputs (``fixtures/gpu-traces``: the only GPU truth the
tests have), shared by the planning and policy tests."""
from __future__ import annotations

from pathlib import Path

from chameleon_swap.planning.modes import Block


def gpu_keep_view(name: str, n_blocks: int = 8):
    """The engine's own trace of an HF Llama 4096x8 step at 16k tokens on an H100 (tests/fixtures/
    gpu-traces), as a keep view: its save order cut into ``n_blocks`` equal runs of spans between
    the first and the last few (embedding, head), each run a block of its slots' compute."""
    from chameleon_swap.runtime.trace import load
    tr = load(Path(__file__).resolve().parent / "fixtures" / "gpu-traces" / name)
    step = tr.steps[-1]
    prof = step.profile(*tr.link)
    n = prof.n_forward
    lo, hi = 2, n - 4
    per = (hi - lo) // n_blocks
    blocks = []
    for b in range(n_blocks):
        first, end = lo + b * per, lo + (b + 1) * per
        blocks.append(Block(first, end, float(sum(prof.compute[first:end])),
                            prof.spans[first].nbytes,
                            selective_bytes=sum(sp.nbytes for sp in prof.spans[first:end]) // 2,
                            selective_seconds=0.25 * float(sum(prof.compute[first:end]))))
    return prof, blocks

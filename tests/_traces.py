"""Keep views the planning and policy tests plan from: hand-built ones (``keep_view``) and the
project's own GPU traces (``fixtures/gpu-traces``: the only GPU truth the tests have)."""
from __future__ import annotations

from pathlib import Path

from chameleon_swap.planning.modes import Block
from chameleon_swap.planning.timeline import Profile, Span


MB = 2**20


def keep_view(n_blocks=4, per_block=3, nbytes=MB, fwd=1e-3, bw=1e9, selective=None,
              input_bytes=None):
    """A decoder-like step: each block saves ``per_block`` spans in its own forward slots;
    backward needs them in reverse order at twice the forward cost."""
    n = n_blocks * per_block
    compute = [fwd] * n + [fwd] + [2 * fwd] * n
    spans = [Span(nbytes, i, n + 1 + (n - 1 - i)) for i in range(n)]
    prof = Profile(compute, n, spans, bw, bw)
    sel_b = None if selective is None else int(selective * per_block * nbytes)
    sel_s = None if selective is None else selective * per_block * fwd
    blocks = [Block(b * per_block, (b + 1) * per_block, per_block * fwd,
                    input_bytes if input_bytes is not None else nbytes // 2, sel_b, sel_s)
              for b in range(n_blocks)]
    return prof, blocks


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

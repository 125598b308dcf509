"""Record traces from a real run: a registered workload under the engine with ``trace_dir``.

The only part of ``sim`` that imports torch (and the workloads), and only when called.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from ..runtime.trace import Trace, load


def record(workload: str, out_dir, *, steps: int = 4, size: str = "small",
           budget: Optional[int] = None, policy: str = "guard", device: str = "cpu",
           seed: int = 0, advance: Callable[[], None] = lambda: None) -> Trace:
    """Run ``steps`` batches of ``workload`` (``chameleon_swap.workloads.get_workload``) under
    ``Chameleon(budget, policy=policy, trace_dir=out_dir)`` and return the recorded trace."""
    import torch

    import chameleon_swap as cs
    try:
        from chameleon_swap.workloads import get_workload
    except ImportError as exc:
        raise ValueError("recording needs the workload registry "
                         "(chameleon_swap.workloads.get_workload)") from exc
    wl = get_workload(workload, size)
    dev = torch.device(device)
    model = wl.build(dev, torch.float32, seed)
    batches = wl.batches(steps, dev, seed)
    out = Path(out_dir)
    if out.exists() and any(out.glob("step-*.json")):
        raise ValueError(f"--out {str(out)!r} already holds step traces; choose an empty directory")
    with cs.Chameleon(budget, device=dev, policy=policy, trace_dir=out) as eng:
        for batch in batches:
            model.zero_grad(set_to_none=True)
            with eng.step():
                wl.run(model, batch)
            advance()
    return load(out)

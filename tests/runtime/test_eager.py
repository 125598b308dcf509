"""``_eager``: the engine's hooks are kept out of torch.compile, and cost one C call in eager code."""
from __future__ import annotations

import torch

from chameleon_swap.runtime._eager import eager, frame_callback, mark_eager


def test_eager_calls_through_in_eager_code_and_is_disabled_for_dynamo():
    calls = []

    def hook(x):
        calls.append(x)
        return x * 2

    wrapped = eager(hook)
    assert frame_callback() is None                        # plain eager code
    assert wrapped(3) == 6 and calls == [3]
    assert getattr(wrapped, "_torchdynamo_disable", False)  # dynamo does not inline it
    assert eager(wrapped) is not None


def test_a_disabled_hook_runs_eagerly_under_a_compiled_function():
    """A compiled function with a graph break calls the hook at run time: it must run as
    written (its frame not compiled), with the same result."""
    seen = []

    def hook(t):                                           # the pattern of resident.py's hooks
        if frame_callback() is not None:
            return disabled(t)
        seen.append(frame_callback() is None)
        return t + 1

    hook, disabled = mark_eager(hook)
    assert eager(hook) is hook                             # marked once, not wrapped again

    @torch.compile(backend="eager")
    def f(x):
        y = x.sin()
        torch._dynamo.graph_break()
        return hook(y) * 2

    try:
        x = torch.randn(4)
        assert torch.equal(f(x), (x.sin() + 1) * 2)
        assert seen == [True]              # its body ran once, with no frame callback active
    finally:
        torch._dynamo.reset()

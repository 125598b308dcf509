"""What the framework callbacks share: building the engine, one ``eng.step()`` held open across
two framework events, and the per-step figures they log."""
from __future__ import annotations

import inspect
from typing import Iterable, Optional

import chameleon_swap as cs

PREFIX = "chameleon/"


def check_engine_kwargs(engine_kwargs: dict, owner: str) -> None:
    """Fail when the callback is created, not at the first training step, on a keyword the
    engine does not take (its values are checked when the engine is built)."""
    try:
        inspect.signature(cs.Chameleon).bind(**engine_kwargs)
    except TypeError as e:
        raise TypeError(f"{owner}(**engine_kwargs) takes the keyword arguments of "
                        f"chameleon_swap.Chameleon: {e}") from None


def accepts_model() -> bool:
    """Whether this version of the engine takes ``model=`` (the module it may recompute)."""
    return "model" in inspect.signature(cs.Chameleon).parameters


def make_engine(engine_kwargs: dict, model=None, device=None):
    """The engine for one training run: the user's keywords win; the framework's model and device
    fill in what the user left out (``model`` only where the engine accepts it)."""
    kwargs = dict(engine_kwargs)
    if model is not None and "model" not in kwargs and accepts_model():
        kwargs["model"] = model
    if device is not None:
        kwargs.setdefault("device", device)
    return cs.Chameleon(**kwargs)


class StepSpan:
    """One ``eng.step()`` entered at one framework event and left at a later one.

    The step's context manager is entered and exited by hand because a framework calls its
    callbacks as separate functions; entering and leaving happen on the same thread, around the
    framework's own (properly nested) contexts, so the saved-tensor hooks stack stays in order.
    """

    def __init__(self) -> None:
        self._cm = None

    @property
    def is_open(self) -> bool:
        return self._cm is not None

    def open(self, engine) -> None:
        if self._cm is not None:
            raise RuntimeError("a Chameleon step is already open; close it first")
        cm = engine.step()
        cm.__enter__()
        self._cm = cm

    def close(self, exc: Optional[BaseException] = None) -> bool:
        """Leave the open step, if any: normally, or as failed when ``exc`` is given (the engine
        then releases everything the step holds, as when an exception leaves ``with eng.step()``).
        Returns whether a step was open."""
        cm, self._cm = self._cm, None
        if cm is None:
            return False
        if exc is None:
            cm.__exit__(None, None, None)
        else:
            cm.__exit__(type(exc), exc, exc.__traceback__)
        return True


def figures(stats: Iterable) -> dict:
    """The numbers to log for the engine steps since the last log: most resident bytes (max),
    bytes moved and stalls (sums), the last budget. Plain floats, so every logger accepts them."""
    stats = list(stats)
    if not stats:
        return {}
    out = {
        "steps": len(stats),
        "peak_resident_bytes": max(s.peak_resident_bytes for s in stats),
        "offloaded_bytes": sum(s.offloaded_bytes for s in stats),
        "moved_back_bytes": sum(s.prefetched_bytes + s.fetched_bytes for s in stats),
        "sync_fetches": sum(s.sync_fetches for s in stats),
        "stall_seconds": sum(s.stall_seconds for s in stats),
        # Steps whose device-inclusive time is not known yet (None) are left out of the sum.
        "step_seconds": sum(s.step_seconds for s in stats if s.step_seconds is not None),
    }
    if stats[-1].budget_bytes is not None:
        out["budget_bytes"] = stats[-1].budget_bytes
    return {PREFIX + k: float(v) for k, v in out.items()}

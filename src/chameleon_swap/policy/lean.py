"""Sizes the budget holds whole, and the lean path their steps run on.

A step on the executor's path that recomputed nothing (with ``model=``: every block ran kept)
shows what its size saves when nothing moves or recomputes: its saved bytes (with what earlier
steps' graphs still held). Where that is within the budget, keeping everything is the cheapest
plan there is (no copy, no recompute), and what the engine does per saved tensor is all it adds.
From then on the size's steps run on the lean path: the saved-tensor hooks of an engine that
never moves (``runtime/resident.py``), no policy call per save, module calls past the engine (its
global module hooks out of their way, ``Chameleon._go_lean``; with ``model=`` the model's buffers
checked once instead), every block run as written, no profile. Nothing on such a step is a
choice, so nothing is planned, checked or learnt from it but its time.

Where a step's size is known decides where its lean path starts. With ``model=``, at its first
block (the mode plans' key, ``signatures.step_size`` of the block's input); without, at its
first saved storage, whose shape and dtype key the size (an LLM's first save is its token ids:
(batch, length)), from the save after it. What was saved before stays on the executor's path,
movable.

Measured on this project's 2-core CPU (the emulated-link benchmark's 8-block HF Llama, 384
tokens, thread CPU time, interleaved): a budget the step never reaches cost 1.044x the plain
step on the executor's path (1.066x with ``model=``); the hooks of an engine that never moves,
0.997x. The cost is spread over the per-save path (no single part of it above 2.5%), so the
way to cut it is a path with fewer parts, not a faster part.

A size within ``SLACK`` of the budget is taken too (the benchmark's budgets are shares of the
longest length's peak, and a length at that share saves a few bytes more than it: 384 tokens at
75% of 512's, 5 bytes over): a save that would pass the budget ends the lean path for the rest
of the step (a trip, ``Executor.lean_limit``). The executor's path keeps the budget from there,
with the policy on no plan (the guard): it moves what the step saved before its lean path began
(on the executor's path, so movable) or copies the new tensor out before its hook returns. A
tripped step that had to move more than ``SLACK`` of the budget sends its size back to the
executor's path, whose plans move early and overlapped, until an all-kept step there shows it
fits again (a step that grew: another routing of an MoE, a longer sequence in the same bucket).
"""
from __future__ import annotations

import statistics
from typing import Optional

SLACK = 0.02        # a size this far over the budget may run lean (it trips near its end)
RUNS_KEPT = 3       # lean steps' times kept per size


class LeanSizes:
    def __init__(self) -> None:
        self.on = False                        # the engine can run lean steps (``_lean_ok``)
        # A size's key: with model=, its mode plans' (``signatures.step_size``); else the shape
        # and dtype of its first saved storage (``Chameleon._first_save``).
        self.key = None                        # this step's
        self.fits: dict = {}                   # key -> bytes its last all-kept step saved
        self.runs: dict = {}                   # key -> its last lean steps' seconds

    def wants(self, key, budget: Optional[int]) -> bool:
        """A step of size ``key`` runs lean (from where its size is known: see above)."""
        fit = self.fits.get(key)
        return self.on and budget is not None and fit is not None and fit <= budget * (1 + SLACK)

    def learn(self, key, ex, calls: Optional[list] = None) -> None:
        """A step on the executor's path, of size ``key``, ended: where every block ran kept
        (``calls``, its blocks' calls; None without model=), what it saved (``ex``'s counters,
        with the bytes of earlier steps' graphs still held)."""
        if key is None or ex.budget is None or calls is not None and (
                not calls or any(c.mode != "keep" for c in calls)):
            return
        earlier = sum(r.nbytes for r in ex._earlier if r.counted)
        self.fits[key] = ex.stats.saved_bytes + earlier

    def ran(self, key, seconds: Optional[float], moved: int, budget: int) -> None:
        """A lean step of ``key`` took ``seconds`` and moved ``moved`` bytes after a trip."""
        if seconds is not None:
            seen = self.runs.setdefault(key, [])
            seen.append(seconds)
            del seen[:-RUNS_KEPT]
        if moved > budget * SLACK:
            self.fits.pop(key, None)           # back to the executor's path (see above)

    def predicted(self, key) -> Optional[float]:
        """A lean step's predicted time: the low median of the size's last lean steps."""
        seen = self.runs.get(key)
        return statistics.median_low(seen) if seen else None


def end_lean(policy, profile) -> None:
    """``ChameleonPolicy.end_step`` of a lean step: what it reports, and its time. Its source
    is "cache" (its size's decision found), "guard" where it tripped (no plan held the rest)."""
    policy.guard.end_step()
    policy.host_room.end_step()
    m = policy.modes
    predicted = m.lean_sizes.predicted(m.lean_sizes.key)   # (from the steps before this one)
    if profile is not None:
        m.end_lean(profile.step_seconds, policy.ex.stats.offloaded_bytes)
    tripped = m.tripped
    policy._report = {"plan_source": "guard" if tripped else "cache",
                      "plan_overrides": policy.overrides,
                      "predicted_stall_seconds": None if tripped else 0.0,
                      "predicted_step_seconds": predicted,
                      "background_planning_seconds": m.landed()}
    policy.pinned_step = False
    policy.step_no += 1


def learn_step(policy, profile) -> None:
    """``ChameleonPolicy.end_step`` of a step on the executor's path: its size's fit."""
    if profile is not None:
        m = policy.modes
        m.lean_sizes.learn(m.lean_sizes.key, policy.ex, profile.blocks if m.eligible else None)


def trip(policy) -> None:
    """A lean step's save would pass the budget (``Executor.on_trip``): the policy holds it on no
    plan from here on (the guard's rules), as on a step it has never seen."""
    policy._alive, policy._active, policy._fuzzy = [], None, None
    policy.modes.tripped = True

"""Run workloads under baselines and budgets, side by side, and turn what happened into records.

For each workload the schedule is drawn once (``workload.batches``) and every baseline trains a
model built from the same seed on exactly those batches, with the same optimizer, so every loss
can be compared bit for bit with ``none``. Two passes:

1. **Timed**: the baselines take turns step by step (the order rotates every step), so drift of the
   machine hits all of them alike; step times are medians over the steps after ``warmup``. On CUDA
   the peak is ``max_memory_allocated`` above what was allocated when the step began.
2. **Metered** (CPU, or when asked): fresh models, the same steps, each under a ``MemoryMeter``:
   the step's device memory on any device, and its curve for the plots. Never timed.

On CUDA the baselines run one after the other instead (``interleave=False``), since models that
wait their turn would sit in the capped device memory of the others.

**Exactness.** When ``none`` runs, the timed pass runs it twice (the second run, labelled
``none (repeat)``, takes its turn like any baseline and makes no record). Where the two agree bit
for bit, every baseline's losses must equal ``none``'s bit for bit (``losses_identical``). Where
they do not (nondeterministic kernels: two plain steps of the video DiT on an H100 differed by
1.2e-7 in the loss), the records say so (``reference_reproducible`` false, ``reference_max_diff``)
and ``losses_within_reference`` tells whether a baseline's largest difference from ``none``
(``losses_max_diff``) stays within the reference's own (see ``records``).

A run that runs out of memory (``torch.cuda.OutOfMemoryError``, ``HostMemoryError``) is stopped
and reported as ``oom``; the sweep goes on.

Budgets are sizes ("512MiB") or fractions of the workload's natural activation peak ("30%"), the
most bytes one step of the schedule saves for backward with nothing moved, measured first by an
engine with no budget. Baselines that know no budget run once per workload; each budget then asks
whether they fit: ``memory_cap_bytes`` is the memory the no-engine step would have needed had its
saved activations been held to the budget at every moment (measured on its metered steps:
``MemoryMeter.caps``), what an ideal swapper with free copies would need. A run ``fits`` when on
every step its peak is at most that step's cap plus the largest activation the step saved: the
tensors the running backward node reads must be on the device whatever the budget (the engine
hands one it could not make room for to autograd outside its budget, as any swapper must).
"""
from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch

from ..config import parse_size
from ..copy.host_pool import HostMemoryError
from ..engine import Chameleon, paused_hooks
from ..workloads import get_workload
from ..workloads.base import Batch, Workload
from .baselines import ENGINE_BASELINES, Baseline, check_baselines, make_baseline
from .meter import MemoryMeter
from .records import records

DEFAULT_LR = 1e-3
PROBE_STEPS = 12         # distinct shapes of the schedule the natural-peak probe runs


# --------------------------------------------------------------------------- budgets
@dataclass(frozen=True)
class Budget:
    label: str                       # as given: "30%" or "512MiB"
    fraction: Optional[float] = None
    nbytes: Optional[int] = None

    def resolve(self, natural_peak: int) -> int:
        return int(natural_peak * self.fraction) if self.fraction is not None else self.nbytes


def parse_budget(value: Union[str, int, float]) -> Budget:
    """ "30%" -> a fraction of the natural activation peak; anything else -> a size."""
    if isinstance(value, str) and value.strip().endswith("%"):
        text = value.strip()[:-1]
        try:
            pct = float(text)
        except ValueError:
            pct = float("nan")
        if not 0 <= pct <= 100:                   # also false for nan
            raise ValueError(f"budget must be a percentage of the natural activation peak "
                             f"between 0% and 100% (e.g. '30%') or a size such as '512MiB'; "
                             f"got {value!r}")
        return Budget(value.strip(), fraction=pct / 100)
    n = parse_size(value, "budget", allow_none=False)
    return Budget(str(value), nbytes=n)


# --------------------------------------------------------------------------- configuration
@dataclass
class SweepConfig:
    workloads: Sequence[str] = ("llama-varlen", "moe")
    baselines: Sequence[str] = ("none", "chameleon")
    budgets: Sequence[Union[str, int]] = ("30%",)
    steps: int = 12                   # timed steps after the warm-up
    warmup: int = 2
    size: str = "small"
    device: Optional[str] = None
    seed: int = 0
    meter: Optional[bool] = None      # metered pass (default: on the CPU)
    interleave: Optional[bool] = None  # default: True on the CPU, False on CUDA
    lr: float = DEFAULT_LR
    device_memory: Optional[Union[str, int]] = None   # CUDA: cap the process's device memory
    threads: Optional[int] = None     # CPU intra-op threads (default: all cores but one)
    workload_overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from ..copy.bandwidth import resolve_device
        for name in ("steps", "warmup", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "steps" else 0):
                least = 1 if name == "steps" else 0
                raise ValueError(f"{name} must be an int >= {least}; got {v!r}")
        if isinstance(self.workloads, str) or not self.workloads:
            raise ValueError(f"workloads must be a non-empty list of names; got {self.workloads!r}")
        self.baselines = check_baselines(self.baselines)
        if not self.baselines:
            raise ValueError("baselines must name at least one baseline")
        if isinstance(self.budgets, str) or not self.budgets:
            raise ValueError(f"budgets must be a non-empty list such as ['30%', '64MiB']; "
                             f"got {self.budgets!r}")
        self.parsed_budgets = [parse_budget(b) for b in self.budgets]
        self.torch_device = resolve_device(
            self.device or ("cuda" if torch.cuda.is_available() else "cpu"), "device")
        cuda = self.torch_device.type == "cuda"
        self.meter = (not cuda) if self.meter is None else bool(self.meter)
        self.interleave = (not cuda) if self.interleave is None else bool(self.interleave)
        self.device_memory_bytes = parse_size(self.device_memory, "device_memory")
        if self.device_memory_bytes is not None and not cuda:
            raise ValueError("device_memory caps CUDA memory (set_per_process_memory_fraction); "
                             f"this sweep runs on {self.torch_device}")
        if self.threads is None and not cuda:
            # The copy workers stand in for a GPU's copy engines, which run beside its compute
            # units: leave them a core instead of letting them fight compute for it.
            self.threads = max(1, (os.cpu_count() or 2) - 1)
        if self.threads is not None and (isinstance(self.threads, bool)
                                         or not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be a positive int (CPU intra-op threads); "
                             f"got {self.threads!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"lr must be a positive number; got {self.lr!r}")
        # Resolve every workload now, so a typo fails before anything runs.
        self.resolved = [get_workload(w, self.size, **self.workload_overrides.get(w, {}))
                         for w in self.workloads]


# --------------------------------------------------------------------------- one model, one way
def _is_oom(e: BaseException) -> bool:
    if isinstance(e, HostMemoryError):
        return True
    oom = getattr(torch.cuda, "OutOfMemoryError", ())
    return (oom and isinstance(e, oom)) or "out of memory" in str(e).lower()


class Runner:
    """One baseline training its own model on the schedule."""

    def __init__(self, workload: Workload, baseline: Baseline, device: torch.device, seed: int,
                 lr: float) -> None:
        self.workload, self.baseline, self.device = workload, baseline, device
        model = workload.build(device, seed=seed)
        self.model = baseline.prepare(model, workload)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.error: Optional[str] = None
        self.oom = False

    def step(self, batch: Batch) -> torch.Tensor:
        with self.baseline.step():
            loss = self.workload.run(self.model, batch)
        if batch.train and batch.optimizer_step:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return loss

    def fail(self, e: BaseException) -> None:
        self.oom = _is_oom(e)
        self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        self.release()

    def release(self) -> None:
        self.model = self.opt = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def natural_peak(workload: Workload, batches: Sequence[Batch], device: torch.device,
                 seed: int) -> int:
    """Most saved-activation bytes one training step of the schedule keeps with nothing moved,
    measured by an engine with no budget on the first step of each distinct shape (``tag``), up
    to ``PROBE_STEPS`` of them: the largest bucket counts even when it comes late."""
    probe, tags = [], set()
    for b in batches:
        if b.train and b.tag not in tags and len(probe) < PROBE_STEPS:
            tags.add(b.tag)
            probe.append(b)
    model = workload.build(device, seed=seed)
    peaks = []
    with Chameleon(None, device=device, policy="guard") as eng:
        for b in probe:
            with eng.step():
                workload.run(model, b)
            model.zero_grad(set_to_none=True)
            peaks.append(eng.last_step.peak_resident_bytes)
    del model
    return max(peaks) if peaks else 0


# --------------------------------------------------------------------------- the sweep
Progress = Callable[[str], None]     # called once per step run, with a short description


@dataclass
class Run:
    """One (baseline, budget) over the schedule: raw per-step observations of both passes."""

    baseline: str
    label: str
    budget: Optional[Budget]
    budget_bytes: Optional[int]
    seconds: list = field(default_factory=list)       # timed pass, per step (None: not run)
    losses: list = field(default_factory=list)
    stats: list = field(default_factory=list)         # baseline.stats() per step
    device_peaks: list = field(default_factory=list)  # CUDA: bytes above the step's start
    metered_peaks: list = field(default_factory=list)
    metered_caps: list = field(default_factory=list)  # none only: {budget bytes: cap} per step
    metered_losses: list = field(default_factory=list)
    curves: dict = field(default_factory=dict)        # step -> [(s, live, saved)], metered
    oom: bool = False
    error: Optional[str] = None
    repeat: bool = False             # the reference's second run, for its reproducibility


def _passes(runs_and_baselines, schedule, cfg, seed, workload, *, metered: bool,
            progress: Optional[Progress], curve_steps: set, budgets: Sequence[int] = ()) -> None:
    device = cfg.torch_device
    runners = []
    for run, baseline in runs_and_baselines:
        if run.error:
            continue
        try:
            runners.append((run, Runner(workload, baseline, device, seed, cfg.lr)))
        except Exception as e:          # building the model can run out of memory too
            if not _is_oom(e):
                raise
            run.oom, run.error = True, f"{type(e).__name__}: {e}"
    n = len(runners)
    if not n:
        return

    def one(run: Run, r: Runner, i: int, batch: Batch) -> None:
        if r.error:
            return
        # Each baseline as it would run alone: no other baseline's engine's idle module hooks
        # on its module calls (``engine.paused_hooks``).
        others = [e for _, o in runners if o is not r
                  for e in (getattr(o.baseline, "engine", None),) if e is not None]
        with paused_hooks(others):
            _one(run, r, i, batch)

    def _one(run: Run, r: Runner, i: int, batch: Batch) -> None:
        try:
            if metered:
                # The no-engine run also counts its saved activations, for the memory each
                # budget implies (``MemoryMeter.caps``).
                m = MemoryMeter(device, record_curve=i in curve_steps,
                                budgets=budgets if run.baseline == "none" else ())
                with m:
                    loss = r.step(batch)
                run.metered_peaks.append(m.peak_bytes)
                if m.budgets:
                    run.metered_caps.append({**m.caps, "largest": m.largest_saved_bytes})
                run.metered_losses.append(loss)
                if i in curve_steps:
                    run.curves[i] = m.curve
            else:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                    start = torch.cuda.memory_allocated(device)
                _sync(device)
                t0 = time.perf_counter()
                loss = r.step(batch)
                _sync(device)
                run.seconds.append(time.perf_counter() - t0)
                run.losses.append(loss)
                run.stats.append(r.baseline.stats())
                if device.type == "cuda":
                    run.device_peaks.append(torch.cuda.max_memory_allocated(device) - start)
        except Exception as e:
            if not _is_oom(e):
                raise
            r.fail(e)
            run.oom, run.error = True, r.error

    what = "metered" if metered else "timed"
    if cfg.interleave:
        for i, batch in enumerate(schedule):
            k = i % n
            for run, r in runners[k:] + runners[:k]:
                one(run, r, i, batch)
                if progress:
                    progress(f"{workload.name} {what} {run.label}")
    else:
        for run, r in runners:
            for i, batch in enumerate(schedule):
                one(run, r, i, batch)
                if progress:
                    progress(f"{workload.name} {what} {run.label}")
    for _, r in runners:
        r.release()


def steps_per_workload(cfg: SweepConfig) -> int:
    """Step runs one workload takes (for progress bars): both passes, every run."""
    peers = [b for b in cfg.baselines if b not in ENGINE_BASELINES]
    engines = [b for b in cfg.baselines if b in ENGINE_BASELINES]
    runs = len(peers) + len(engines) * len(cfg.parsed_budgets)
    repeat = 1 if "none" in cfg.baselines else 0       # the reference's second timed run
    return (cfg.warmup + cfg.steps) * (runs * (2 if cfg.meter else 1) + repeat)


def run_workload(cfg: SweepConfig, workload: Workload, progress: Optional[Progress] = None,
                 natural: Optional[int] = None) -> tuple[list[Run], dict]:
    """Every baseline (and budget, for the engine's policies) on one workload. ``natural`` is
    its natural activation peak when already measured."""
    device = cfg.torch_device
    schedule = workload.batches(cfg.warmup + cfg.steps, device, seed=cfg.seed)
    if natural is None:
        natural = natural_peak(workload, schedule, device, cfg.seed)
    pairs: list = []
    for name in cfg.baselines:
        if name in ENGINE_BASELINES:
            for b in cfg.parsed_budgets:
                nbytes = b.resolve(natural)
                pairs.append((Run(name, name, b, nbytes), make_baseline(name, device, nbytes)))
        else:
            base = make_baseline(name, device, None)
            pairs.append((Run(name, base.label, None, None), base))
    # The reference runs twice in the timed pass: is it bitwise reproducible at all?
    repeat = None
    if "none" in cfg.baselines:
        repeat = (Run("none", "none (repeat)", None, None, repeat=True),
                  make_baseline("none", device, None))
    # Curves for the plots: the training step with the most tokens (the largest shapes).
    train = [i for i, b in enumerate(schedule) if b.train]
    curve_steps = {max(train, key=lambda i: (schedule[i].tokens, -i))} if train else set()
    try:
        _passes(pairs + ([repeat] if repeat else []), schedule, cfg, cfg.seed, workload,
                metered=False, progress=progress, curve_steps=curve_steps)
        if cfg.meter:
            budgets = sorted({b.resolve(natural) for b in cfg.parsed_budgets})
            _passes(pairs, schedule, cfg, cfg.seed, workload, metered=True, progress=progress,
                    curve_steps=curve_steps, budgets=budgets)
    finally:
        for _, base in pairs + ([repeat] if repeat else []):
            base.close()
    info = {"natural_peak_bytes": natural, "schedule": [_batch_info(b) for b in schedule],
            "curve_steps": sorted(curve_steps),
            "reference_repeat": repeat[0] if repeat else None}
    return [run for run, _ in pairs], info


def _batch_info(b: Batch) -> dict:
    return {"tag": b.tag, "train": b.train, "tokens": b.tokens, "optimizer_step": b.optimizer_step}


def run_sweep(cfg: SweepConfig, env: dict, progress: Optional[Progress] = None,
              on_workload: Optional[Callable[[str, list, dict], None]] = None,
              natural_peaks: Optional[dict] = None) -> list[dict]:
    """Every workload of ``cfg``; returns the records (see the module docstring).
    ``on_workload(name, records, info)`` is called as each workload ends (``info["runs"]`` holds
    the raw runs, curves included)."""
    device = cfg.torch_device
    if cfg.device_memory_bytes is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.device_memory_bytes / total),
                                                   device)
    threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    out = []
    try:
        for w in cfg.resolved:
            runs, info = run_workload(cfg, w, progress, (natural_peaks or {}).get(w.name))
            recs = records(cfg, w, runs, info, {**env, "cpu_threads": torch.get_num_threads()})
            if on_workload:
                on_workload(w.name, recs, {**info, "runs": runs})
            out.extend(recs)
    finally:
        torch.set_num_threads(threads)
    return out

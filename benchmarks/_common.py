"""Shared plumbing of the benchmark scripts: environment facts, progress, result files.

Every benchmark writes ``benchmarks/results/<name>-<device-slug>.json`` with the device, torch
version, commit, config and medians, plus a markdown table next to it (and a PNG when matplotlib is
installed). Comparisons are ratios of runs interleaved in one process, never absolute times from
different runs.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Iterable, Optional

import torch

# Facts and the progress bar are shared with the package's bench commands.
from chameleon_swap.bench.env import delay_note, device_name, device_slug, environment, git_commit, progress  # noqa: F401,E501

RESULTS = Path(__file__).resolve().parent / "results"


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_counts(p, a, positive, non_negative=("warmup",)) -> None:
    """``p.error`` (argparse's clear exit) unless each of ``positive`` is > 0 and each of
    ``non_negative`` is >= 0 (names as attributes of ``a``; flags spelled with dashes)."""
    for k in positive:
        if getattr(a, k) <= 0:
            p.error(f"--{k.replace('_', '-')} must be a positive integer; got {getattr(a, k)}")
    for k in non_negative:
        if getattr(a, k) < 0:
            p.error(f"--{k.replace('_', '-')} must be >= 0; got {getattr(a, k)}")


# ``--emulate-link H100_LINK``: the link at an H100's ratio of bytes to compute, measured on this
# machine when the model is built (``chameleon_swap.bench.choice.h100_link``).
H100_LINK = "h100"


def check_emulated_link(p, a, gpu: bool) -> None:
    """``--emulate-link``: ``p.error`` where the device is a GPU (``gpu``: its link is real) or
    the value is neither ``h100`` nor a bandwidth ``chameleon_swap.config.parse_bandwidth``
    takes."""
    if a.emulate_link is None:
        return
    if gpu:
        p.error("--emulate-link slows the CPU's copies; on a GPU the link is real")
    if a.emulate_link.lower() == H100_LINK:
        a.emulate_link = H100_LINK
        return
    from chameleon_swap.config import parse_bandwidth
    try:
        parse_bandwidth(a.emulate_link, "--emulate-link")
    except (TypeError, ValueError) as exc:
        p.error(f"{exc} (or '{H100_LINK}': an H100's ratio of bytes to compute, measured here)")


def link_bandwidth(link, forward, saved_bytes: int):
    """What the engines' ``emulate_link=`` gets for ``--emulate-link`` ``link``, in bytes per
    second (None for none): the bandwidth given, or for ``h100`` the one at an H100's ratio on
    this machine, from ``forward()`` (one training forward of the step that saves
    ``saved_bytes``). The results record it as ``emulated_link_bytes_per_s``."""
    if link != H100_LINK:
        from chameleon_swap.config import parse_bandwidth
        return parse_bandwidth(link, "--emulate-link")
    from chameleon_swap.bench.choice import h100_link
    return h100_link(forward, saved_bytes)


def link_words(config: dict) -> str:
    """A result's link as its tables say it: ``130MB/s``, or ``h100 ratio (352 MB/s)``."""
    link = config.get("emulated_link")
    bw = config.get("emulated_link_bytes_per_s")
    if link == H100_LINK and bw:
        return f"h100 ratio ({bw / 1e6:.0f} MB/s)"
    return link or "real"


def timed(device: torch.device, fn):
    """Run ``fn()`` synchronized on both sides: (its result, wall seconds, the device memory it
    allocated above what was allocated when it began, CUDA only, else None)."""
    sync(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = now()
    out = fn()
    sync(device)
    dt = now() - t0
    return out, dt, (torch.cuda.max_memory_allocated(device) - base) if cuda else None


def markdown_table(header: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_results(name: str, device: torch.device, payload: dict, markdown: str,
                  out_dir: Optional[Path] = None) -> Path:
    out = Path(out_dir) if out_dir else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{device_slug(device)}"
    path = out / f"{stem}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    (out / f"{stem}.md").write_text(markdown)
    return path


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


def now() -> float:
    return time.perf_counter()


def add_threads_argument(p) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="CPU compute threads (default on the CPU: all cores but one, left to the "
                        "copy threads, as the bench harness does)")


def apply_threads(a) -> None:
    """On the CPU, leave one core to the engine's copy workers (a GPU's copy engines run beside
    its compute units); every mode of the run uses the same setting, so ratios stay fair."""
    import os
    if a.threads is None and not str(a.device).startswith("cuda"):
        a.threads = max(1, (os.cpu_count() or 2) - 1)
    if a.threads is not None:
        if a.threads < 1:
            raise SystemExit(f"--threads must be a positive int; got {a.threads}")
        torch.set_num_threads(a.threads)


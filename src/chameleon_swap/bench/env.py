"""Facts every result file carries (device, torch, commit, ...), and a progress bar.

Shared by the ``bench`` and ``demo`` commands and the scripts under ``benchmarks/``; torch is
imported only where a device is asked about, so torch-free scripts (``planner_gap.py``) use it too.
"""
from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:
    import torch


def git_commit() -> str:
    """HEAD of the checkout this package runs from, "-dirty" when tracked files changed;
    "unknown" outside a git checkout (an installed wheel)."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: "torch.device") -> str:
    if device.type == "cuda":
        import torch
        return torch.cuda.get_device_name(device)
    return cpu_name()


def device_slug(device: "torch.device") -> str:
    name = device_name(device) if device.type == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def environment(device: "torch.device") -> dict:
    import torch

    from .._version import __version__
    env = {"device": str(device), "device_name": device_name(device),
           "torch": torch.__version__, "chameleon_swap": __version__,
           "python": sys.version.split()[0], "commit": git_commit(),
           "cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
    from ..copy.host_pool import ALLOC_DELAY_ENV
    if float(os.environ.get(ALLOC_DELAY_ENV, "0") or 0):
        # The host arena's testing delay was on: its allocations slept, as pinning is slow
        env["host_alloc_delay_s_per_gib"] = float(os.environ[ALLOC_DELAY_ENV])
    return env


def delay_note(env: dict) -> str:
    """A results header's words for the host arena's testing delay, where it was on."""
    d = env.get("host_alloc_delay_s_per_gib")
    return f", host allocations slowed to {d:g} s a GiB (the arena's testing delay)" if d else ""


@contextmanager
def progress(total: int, description: str) -> Iterator[Callable[..., None]]:
    """Yields ``advance(text="")``: a rich progress bar when rich is installed and stderr is a
    terminal, a line every 10% on stderr otherwise (logs stay readable)."""
    rich = None
    if sys.stderr.isatty():
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
            from rich.progress import TimeElapsedColumn, TimeRemainingColumn
            rich = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[now]}"),
                            transient=False)
        except ImportError:
            rich = None
    if rich is None:
        done = [0]
        every = max(1, total // 10)

        def advance(text: str = "") -> None:
            done[0] += 1
            if done[0] == total or done[0] % every == 0:
                print(f"{description}: {done[0]}/{total} {text}", file=sys.stderr, flush=True)
        yield advance
        return
    with rich:
        task = rich.add_task(description, total=total, now="")
        yield lambda text="": rich.update(task, advance=1, now=text)

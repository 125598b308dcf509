"""Shared plumbing of the benchmark scripts: environment facts, progress, result files.

Every benchmark writes ``benchmarks/results/<name>-<device-slug>.json`` with the device, torch
version, commit, config and medians, plus a markdown table next to it (and a PNG when matplotlib is
installed). Comparisons are ratios of runs interleaved in one process, never absolute times from
different runs.
"""
from __future__ import annotations

import json
import platform
import re
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def git_commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_slug(device: torch.device) -> str:
    name = device_name(device) if device.type == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def environment(device: torch.device) -> dict:
    import chameleon_swap as cs
    env = {"device": str(device), "device_name": device_name(device),
           "torch": torch.__version__, "chameleon_swap": cs.__version__,
           "python": sys.version.split()[0], "commit": git_commit(),
           "cpu_threads": torch.get_num_threads(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
    return env


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def progress(total: int, description: str) -> Iterator:
    """Yields ``advance()``; a rich progress bar when rich is installed, dotted lines otherwise."""
    try:
        from rich.progress import Progress
    except ImportError:
        done = [0]

        def advance() -> None:
            done[0] += 1
            if done[0] == total or done[0] % max(1, total // 10) == 0:
                print(f"{description}: {done[0]}/{total}", file=sys.stderr, flush=True)
        yield advance
        return
    with Progress(transient=False) as bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)


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

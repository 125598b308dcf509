"""The ``chameleon-swap`` command line.

Each command is a pair in :data:`COMMANDS`: a function that adds its arguments to its subparser
and a function that runs it. Adding a command (``demo``, ``bench``, ``simulate``) means writing
those two functions and one entry; only implemented commands are listed, so ``--help`` never
offers something that fails.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from chameleon_swap._version import __version__
from chameleon_swap.config import available_host_memory, format_bytes, parse_size, total_host_memory
from chameleon_swap.bench import commands as _bench
from chameleon_swap.sim import commands as _sim
from chameleon_swap.sim import recovery_cli as _recover

# torch (and everything that imports it) is imported inside the commands that need it: importing
# it takes seconds, and `--version`, `--help` and usage errors should answer at once.
if TYPE_CHECKING:
    import torch

    from chameleon_swap.copy.bandwidth import BandwidthResult

PROG = "chameleon-swap"

Configure = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace, argparse.ArgumentParser], int]


# --------------------------------------------------------------------------------------- info

def _configure_info(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None,
                   help="'cpu' or 'cuda[:N]' (default: cuda if available, else cpu)")
    p.add_argument("--bytes", default="64MiB", metavar="SIZE",
                   help="size of each timed copy, e.g. 4MB, 256MiB (default: 64MiB)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _device_description(dev: "torch.device") -> dict:
    import torch

    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        free, total = torch.cuda.mem_get_info(dev)
        return {"device": str(dev), "device_name": props.name,
                "device_memory_total_bytes": int(total), "device_memory_free_bytes": int(free),
                "cuda_version": torch.version.cuda}
    # "no accelerator" only when that is true: --device cpu on a GPU machine is a choice.
    name = "cpu" if torch.cuda.is_available() else "cpu (no accelerator)"
    return {"device": "cpu", "device_name": name, "device_memory_total_bytes": None,
            "device_memory_free_bytes": None, "cuda_version": torch.version.cuda}


def _bandwidth_fields(bw: "BandwidthResult") -> dict:
    return {"h2d_bytes_per_s": bw.h2d_bytes_per_s, "d2h_bytes_per_s": bw.d2h_bytes_per_s,
            "h2d_gb_per_s": bw.h2d_bytes_per_s / 1e9, "d2h_gb_per_s": bw.d2h_bytes_per_s / 1e9,
            "nbytes": bw.nbytes, "repeats": bw.repeats, "method": bw.method,
            "pinned": bw.pinned}


def _run_info(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # Validate everything before measuring, so a typo costs no allocation.
    import torch

    from chameleon_swap.copy.bandwidth import (measure_bandwidth, pinned_memory_status,
                                               resolve_device)

    try:
        nbytes = parse_size(args.bytes, "--bytes", allow_none=False)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    if nbytes <= 0:
        parser.error(f"--bytes must be a positive size; got {args.bytes!r}")
    requested = args.device if args.device is not None else (
        "cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = resolve_device(requested, "--device")
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))

    bw = measure_bandwidth(dev, nbytes=nbytes)
    pinned_ok, pinned_reason = pinned_memory_status()
    report = {
        "version": __version__,
        **_device_description(dev),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "bandwidth": _bandwidth_fields(bw),
        "pinned_memory": {"available": pinned_ok, "reason": pinned_reason},
        "host_memory_total_bytes": total_host_memory(),
        "host_memory_available_bytes": available_host_memory(),
    }
    if args.json:
        print(json.dumps(report))
        return 0

    if dev.type == "cuda":
        device_line = (f"{report['device']} ({report['device_name']}, "
                       f"{format_bytes(report['device_memory_total_bytes'])} total, "
                       f"{format_bytes(report['device_memory_free_bytes'])} free)")
    else:
        device_line = report["device_name"]
    bwf = report["bandwidth"]
    how = (f"{format_bytes(bwf['nbytes'])} transfers, median of {bwf['repeats']}, "
           f"{bwf['method']}")
    lines = [
        f"{PROG} {__version__}",
        f"device:          {device_line}",
        f"torch:           {report['torch_version']}"
        + (f" (CUDA {report['cuda_version']})" if report["cuda_version"] else ""),
        f"python:          {report['python_version']}",
        f"host -> device:  {bwf['h2d_gb_per_s']:.2f} GB/s ({how})",
        f"device -> host:  {bwf['d2h_gb_per_s']:.2f} GB/s ({how})",
        f"pinned memory:   {'yes' if pinned_ok else 'no'} ({pinned_reason})",
        f"host RAM:        {format_bytes(report['host_memory_total_bytes'])} total, "
        f"{format_bytes(report['host_memory_available_bytes'])} available",
    ]
    print("\n".join(lines))
    return 0


# ---------------------------------------------------------------------------------- plumbing

# name -> (help, configure, run). Only commands that are implemented belong here.
COMMANDS: dict[str, tuple[str, Configure, Run]] = {
    # The main job and the sweep live in chameleon_swap.bench.commands (torch imported lazily).
    "demo": (_bench.DEMO_HELP, _bench.configure_demo, _bench.run_demo),
    "bench": (_bench.BENCH_HELP, _bench.configure_bench, _bench.run_bench),
    "info": ("show the device, copy bandwidth, pinned memory and host RAM",
             _configure_info, _run_info),
    # The simulator's commands live in chameleon_swap.sim.commands (no torch needed).
    "simulate": (_sim.SIMULATE_HELP, _sim.configure_simulate, _sim.run_simulate),
    "capacity": (_sim.CAPACITY_HELP, _sim.configure_capacity, _sim.run_capacity),
    "compare": (_sim.COMPARE_HELP, _sim.configure_compare, _sim.run_compare),
    "trace": (_sim.TRACE_HELP, _sim.configure_trace, _sim.run_trace),
    "recover": (_recover.RECOVER_HELP, _recover.configure, _recover.run),
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Keep a training step's saved activations under a device-memory budget "
                    "by swapping them to host memory.")
    # Handled by hand rather than action="version" so main() returns 0 instead of exiting.
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers = {}
    for name, (help_text, configure, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        configure(p)
        subparsers[name] = p
    return parser, subparsers


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI; returns the exit status. Usage errors raise ``SystemExit(2)`` via argparse."""
    parser, subparsers = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(f"{PROG} {__version__}")
        return 0
    if args.command is None:
        # No command is a usage error: show what exists, on stderr, and fail like argparse does.
        parser.print_help(sys.stderr)
        return 2
    _, _, run = COMMANDS[args.command]
    try:
        # The subparser reports errors, so the usage line shown is the command's own.
        return run(args, subparsers[args.command])
    except BrokenPipeError:
        # `chameleon-swap info | head` closed stdout early: not an error worth a traceback.
        # Point stdout at devnull so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""Measure host<->device copy bandwidth, the figure a swap planner divides bytes by.

Swapping an activation out and back only pays off when the copy hides behind compute, so the
planner needs to know how many bytes per second the link actually moves. That number depends on
the machine (PCIe generation, NVLink-C2C, NUMA placement, whether pinning works), so it is
measured rather than assumed, once per device per process (:func:`cached_bandwidth`).

On CUDA the measurement mirrors how the engine copies: a pinned host buffer, ``non_blocking``
copies on a side stream, timed with CUDA events so host-side launch jitter is not counted. On the
CPU engine "device" and "host" are both RAM, so the honest figure is a plain memcpy between two
CPU tensors, reported as ``method="cpu-memcpy"``.
"""
from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable, Union

import torch

DeviceLike = Union[str, torch.device]

DEFAULT_NBYTES = 64 * 2**20
DEFAULT_REPEATS = 5

# A tiny allocation is enough to learn whether the driver will pin pages at all.
_PIN_PROBE_BYTES = 4096


@dataclass(frozen=True)
class BandwidthResult:
    """One bandwidth measurement; bytes per second are medians over ``repeats`` copies."""

    device: str
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    pinned: bool
    nbytes: int
    repeats: int
    method: str


def resolve_device(device: DeviceLike, name: str = "device") -> torch.device:
    """Check ``device`` and return it in canonical form (``cuda`` becomes ``cuda:<current>``).

    Only ``cpu`` and ``cuda[:N]`` are accepted: those are the engines the library implements.
    Errors are ``ValueError``/``TypeError`` naming ``name`` and what it accepts.
    """
    accepted = "'cpu' or 'cuda[:N]'"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name} must be {accepted} (a str or torch.device); "
                        f"got {type(device).__name__} {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"{name} must be {accepted}; could not parse {device!r}") from exc
    if dev.type == "cpu":
        if dev.index not in (None, 0):
            # torch parses "cpu:1", but there is one CPU device: a typo for cuda:1, not a device.
            raise ValueError(f"{name} must be {accepted}; got {device!r}, but the CPU has no "
                             f"device index (pass 'cpu', or 'cuda:{dev.index}' for a GPU)")
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"{name} must be {accepted}; device type {dev.type!r} is not supported")
    if not torch.cuda.is_available():
        raise ValueError(f"{name} must be {accepted}; got {device!r} but no CUDA device is available")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < count:
        raise ValueError(f"{name} must be {accepted}; got {device!r} but only {count} CUDA "
                         f"device(s) exist (indices 0..{count - 1})")
    return torch.device("cuda", index)


def _check_positive_int(value: object, name: str, minimum: int) -> int:
    # bool is an int subclass: True would silently mean 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}; got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")
    return value


def measure_bandwidth(device: DeviceLike, nbytes: int = DEFAULT_NBYTES,
                      repeats: int = DEFAULT_REPEATS) -> BandwidthResult:
    """Measure host->device and device->host copy bandwidth for ``nbytes`` transfers.

    One warm-up copy per direction (first-touch page faults, lazy CUDA context and allocator
    setup), then the median of ``repeats`` timed copies, which is robust to a stray slow run.
    """
    dev = resolve_device(device)
    _check_positive_int(nbytes, "nbytes", 1)
    _check_positive_int(repeats, "repeats", 1)
    if dev.type == "cuda":
        return _measure_cuda(dev, nbytes, repeats)
    return _measure_cpu(nbytes, repeats)


def _median_rate(nbytes: int, seconds: list[float]) -> float:
    # A timer that reads 0 for a very small copy would divide by zero; clamp to its resolution.
    floor = time.get_clock_info("perf_counter").resolution
    return nbytes / max(statistics.median(seconds), floor)


def _measure_cpu(nbytes: int, repeats: int) -> BandwidthResult:
    # Write both buffers first: reading untouched pages maps the shared zero page, which sits in
    # cache and would report an impossible bandwidth.
    a = torch.full((nbytes,), 1, dtype=torch.uint8)
    b = torch.full((nbytes,), 2, dtype=torch.uint8)

    def timed(dst: torch.Tensor, src: torch.Tensor) -> list[float]:
        dst.copy_(src)  # warm-up
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            out.append(time.perf_counter() - t0)
        return out

    # "host" is a, "device" is b: both RAM, so each direction is the same memcpy, measured anyway
    # so a skewed run shows up instead of being copied from the other figure.
    h2d = timed(b, a)
    d2h = timed(a, b)
    return BandwidthResult(device="cpu", h2d_bytes_per_s=_median_rate(nbytes, h2d),
                           d2h_bytes_per_s=_median_rate(nbytes, d2h), pinned=False,
                           nbytes=nbytes, repeats=repeats, method="cpu-memcpy")


def _measure_cuda(dev: torch.device, nbytes: int, repeats: int) -> BandwidthResult:
    with torch.cuda.device(dev):
        try:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            pinned = True
        except RuntimeError:
            # Pinning can fail (locked-memory limits, containers); pageable copies still work,
            # just slower and synchronous, and the result says so.
            host = torch.empty(nbytes, dtype=torch.uint8)
            pinned = False
        host.fill_(1)
        gpu = torch.full((nbytes,), 2, dtype=torch.uint8, device=dev)
        stream = torch.cuda.Stream(device=dev)
        # The side stream must not start copying before the fill on the current stream is done.
        stream.wait_stream(torch.cuda.current_stream(dev))

        def timed(copy: Callable[[], None]) -> list[float]:
            out = []
            with torch.cuda.stream(stream):
                copy()  # warm-up
                for _ in range(repeats):
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    copy()
                    end.record(stream)
                    end.synchronize()
                    out.append(start.elapsed_time(end) / 1e3)  # ms -> s
            return out

        h2d = timed(lambda: gpu.copy_(host, non_blocking=True))
        d2h = timed(lambda: host.copy_(gpu, non_blocking=True))
        # Buffers were used on the side stream; wait before the allocator may reuse them.
        stream.synchronize()
    return BandwidthResult(device=str(dev), h2d_bytes_per_s=_median_rate(nbytes, h2d),
                           d2h_bytes_per_s=_median_rate(nbytes, d2h), pinned=pinned,
                           nbytes=nbytes, repeats=repeats,
                           method="cuda-events-pinned" if pinned else "cuda-events-pageable")


_cache: dict[str, BandwidthResult] = {}
_cache_lock = threading.Lock()


def cached_bandwidth(device: DeviceLike) -> BandwidthResult:
    """:func:`measure_bandwidth` with default arguments, measured once per device per process.

    The planner asks every time it plans; a measurement costs tens of milliseconds and moves
    hundreds of MiB, so it is done once. ``'cuda'`` and ``'cuda:<current>'`` share one entry.
    """
    key = str(resolve_device(device))
    with _cache_lock:  # two threads planning at once must not both measure (and skew each other)
        result = _cache.get(key)
        if result is None:
            result = measure_bandwidth(key)
            _cache[key] = result
        return result


def clear_bandwidth_cache() -> None:
    """Forget cached measurements (tests; or after the machine's load changed)."""
    with _cache_lock:
        _cache.clear()


def pinned_memory_status() -> tuple[bool, str]:
    """Whether pinned (page-locked) host memory can be allocated, and why (not)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device: pinned memory needs one"
    try:
        torch.empty(_PIN_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return False, f"pin_memory allocation failed: {first_line}"
    return True, f"a {_PIN_PROBE_BYTES}-byte pin_memory allocation succeeded"

"""Size parsing and the engine's validated configuration.

Nothing here touches a torch device: this module only turns user input into checked numbers and
names, so every bad argument fails before any memory is allocated or hook installed.
"""
from __future__ import annotations

import math
import os
import re
from decimal import Decimal, localcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

SizeLike = Union[int, float, str, None]

# Decimal (SI) and binary (IEC) units; bare numbers are bytes.
_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_ACCEPTED = ("a non-negative int of bytes, or a size string such as '512MB', '1.5GiB', "
             "'4096' (units B, KB, MB, GB, TB decimal; KiB, MiB, GiB, TiB and K, M, G, T binary)")

_MAX_BYTES = 2**64  # more than any machine has: a typo, not a budget

POLICIES = ("guard", "chameleon", "static", "schedule")


def parse_size(value: SizeLike, name: str = "size", *, allow_none: bool = True) -> Optional[int]:
    """Parse ``value`` into a number of bytes.

    Accepts a non-negative int, a finite non-negative float that is a whole number of bytes
    (``2e9``) or a string with an optional unit (``"512MB"``, ``"1.5GiB"``, ``"4096"``). ``None``
    passes through when ``allow_none``. Errors name the argument (``name``) and the accepted forms.

    A size is bytes, never a fraction of memory: a float or a bare number string that is not a
    whole number of bytes (``0.5``, ``1.5``, ``"0.5"``) is an error rather than 0 or 1 byte. A
    string with a larger unit is rounded down to whole bytes (``"1.3GiB"``), unless it comes to
    less than one byte without being 0 (``"0.0001KB"``), which is an error too.
    """
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{name} must be {_ACCEPTED}; got None")
    # bool is an int subclass: True would silently mean one byte.
    if isinstance(value, bool):
        raise TypeError(f"{name} must be {_ACCEPTED}; got a bool ({value!r})")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must be {_ACCEPTED}; got {value!r}, which is negative")
        return _bounded(int(value), value, name)
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be {_ACCEPTED}; got {value!r}")
        # Bounded by its shortest repr (what the user typed; the string form of the same number
        # gets the same verdict).
        _bounded(int(Decimal(repr(value))), value, name)
        if not value.is_integer():
            raise ValueError(_fraction_of_a_byte(name, value))
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name} must be {_ACCEPTED}; could not parse {value!r}")
        # Decimal, not float: '4.1MB' is exactly 4100000 bytes and a 17-digit count stays exact.
        # Enough precision for any digit string the pattern lets through at a sane size; an
        # absurd exponent is "too large", never a decimal.Overflow.
        number = Decimal(m.group(1))
        if number.adjusted() > 40:
            raise ValueError(f"{name} must be {_ACCEPTED}; {value!r} is too large")
        with localcontext() as ctx:
            ctx.prec = max(60, len(m.group(1)) + 20)
            result = number * _UNITS[m.group(2).lower()]
        if result != int(result) and (_UNITS[m.group(2).lower()] == 1 or result < 1):
            raise ValueError(_fraction_of_a_byte(name, value))
        return _bounded(int(result), value, name)
    raise TypeError(f"{name} must be {_ACCEPTED}; got {type(value).__name__} {value!r}")


_BANDWIDTH_ACCEPTED = ("None (measured), a positive number of bytes per second, or a string such "
                       "as '1GB/s', '54 GB/s', '25GiB/s' (a size per second)")


def parse_bandwidth(value, name: str = "link_bandwidth") -> Optional[float]:
    """Bytes per second from a number or a ``'<size>/s'`` string; None passes through."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name} must be {_BANDWIDTH_ACCEPTED}; got a bool ({value!r})")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be {_BANDWIDTH_ACCEPTED}; got {value!r}")
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        if not text.lower().endswith("/s"):
            raise ValueError(f"{name} must be {_BANDWIDTH_ACCEPTED}; {value!r} has no '/s'")
        try:
            n = parse_size(text[:-2], name, allow_none=False)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be {_BANDWIDTH_ACCEPTED}; could not parse {value!r}") \
                from None
        if n <= 0:
            raise ValueError(f"{name} must be {_BANDWIDTH_ACCEPTED}; got {value!r}")
        return float(n)
    raise TypeError(f"{name} must be {_BANDWIDTH_ACCEPTED}; got {type(value).__name__} {value!r}")


def _fraction_of_a_byte(name: str, value) -> str:
    hint = (" (a size is bytes, not a fraction of memory: compute the bytes, e.g. "
            "int(0.5 * peak))") if isinstance(value, float) and 0 < value < 1 else ""
    return (f"{name}={value!r} is not a whole number of bytes{hint}; {name} must be {_ACCEPTED}")


def _bounded(n: int, value, name: str) -> int:
    if n > _MAX_BYTES:
        raise ValueError(f"{name} must be {_ACCEPTED}; {value!r} is too large (over 2**64 bytes)")
    return n


def trace_dir_path(value) -> Optional[Path]:
    """``trace_dir`` checked and created: a directory path (str or os.PathLike) or None."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"trace_dir must be a directory path (str or os.PathLike) or None; "
                        f"got {type(value).__name__} {value!r}")
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise ValueError(f"trace_dir must be a directory; {str(path)!r} is a file")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"trace_dir={str(path)!r} could not be created ({e.strerror or e}); pass "
                         f"a directory that exists or can be created, or None") from e
    return path


def format_bytes(n: Optional[float]) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    if n is None:
        return "unlimited"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def available_host_memory() -> Optional[int]:
    """Bytes of host RAM available now (MemAvailable on Linux), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def total_host_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# Pinned memory is taken from RAM the OS cannot page out; leave most of it to the rest of the
# process (data loaders, optimizer states on CPU). Half of what is available is the default.
DEFAULT_HOST_FRACTION = 0.5
DEFAULT_MIN_TENSOR_BYTES = 2**20  # 1 MiB: below this a copy's launch cost outweighs what it frees
DEFAULT_HISTORY_SIZE = 1000       # StepStats kept in eng.history (about 600 B each)
MAX_HISTORY_SIZE = 10**6
# A plan holds one entry per saved tensor of its step; more signatures than this in the LRU is a
# typo (the cache would hold gigabytes), not a workload.
MAX_PLAN_CACHE_SIZE = 4096


@dataclass
class EngineConfig:
    """Validated arguments of :class:`chameleon_swap.Chameleon`."""

    budget: SizeLike = None
    min_tensor_bytes: SizeLike = DEFAULT_MIN_TENSOR_BYTES
    device_memory_limit: SizeLike = None
    policy: str = "chameleon"
    host_memory_limit: SizeLike = None
    host_memory_reserve: SizeLike = None
    # Sequence-change thresholds of the profiler (Chameleon's defaults: 5% length, 0.95 cosine).
    length_tolerance: float = 0.05
    min_similarity: float = 0.95
    plan_cache_size: int = 16
    # Bytes per second per direction the planner assumes for the host link (None: measured).
    link_bandwidth: Union[int, float, str, None] = None
    history_size: int = DEFAULT_HISTORY_SIZE
    # CPU only: copies take as long as a link of this bandwidth would (None: a plain memmove).
    emulate_link: Union[int, float, str, None] = None
    # With model=: mode plans made in a planner process while steps run (policy/background.py).
    plan_in_background: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.plan_in_background, bool):
            raise TypeError(f"plan_in_background must be True (mode plans made in a planner "
                            f"process while steps run) or False (made on the step's thread); got "
                            f"{self.plan_in_background!r}")
        self.link_bandwidth_bytes_per_s = parse_bandwidth(self.link_bandwidth, "link_bandwidth")
        self.emulate_link_bytes_per_s = parse_bandwidth(self.emulate_link, "emulate_link")
        self.length_tolerance = _fraction(self.length_tolerance, "length_tolerance")
        self.min_similarity = _fraction(self.min_similarity, "min_similarity")
        _count(self.plan_cache_size, "plan_cache_size", MAX_PLAN_CACHE_SIZE,
               "plans kept, one per operator-sequence signature")
        _count(self.history_size, "history_size", MAX_HISTORY_SIZE,
               "StepStats kept in eng.history; eng.totals sums every step")
        self.budget_bytes = parse_size(self.budget, "budget")
        self.min_tensor_bytes = parse_size(self.min_tensor_bytes, "min_tensor_bytes", allow_none=False)
        self.device_memory_limit_bytes = parse_size(self.device_memory_limit, "device_memory_limit")
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(repr(p) for p in POLICIES)}; "
                             f"got {self.policy!r}")
        limit = parse_size(self.host_memory_limit, "host_memory_limit")
        _check_host_limit(limit, self.host_memory_limit)
        if limit is None:
            avail = available_host_memory()
            limit = int(avail * DEFAULT_HOST_FRACTION) if avail else 8 * 2**30
        self.host_memory_limit_bytes = limit
        reserve = parse_size(self.host_memory_reserve, "host_memory_reserve")
        if reserve is not None and reserve > limit:
            how = "" if self.host_memory_limit is not None else \
                f" (the default: {DEFAULT_HOST_FRACTION:.0%} of the RAM available now)"
            raise ValueError(f"host_memory_reserve={format_bytes(reserve)} is more than "
                             f"host_memory_limit={format_bytes(limit)}{how}; the reserve is taken "
                             f"from the limit: lower host_memory_reserve or raise host_memory_limit")
        self.host_memory_reserve_bytes = reserve or 0


def _count(value, name: str, most: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise ValueError(f"{name} must be an int from 1 to {most} ({what}); got {value!r}")


def _check_host_limit(limit: Optional[int], given) -> None:
    """0 bytes of host memory, or more than the machine has, is a typo, not a limit."""
    if limit is None:
        return
    if limit == 0:
        raise ValueError("host_memory_limit=0 leaves no host memory for offloaded activations; "
                         "pass a positive size such as '8GiB', or None (half the RAM available); "
                         "to offload nothing, pass budget=None instead")
    total = total_host_memory()
    if total is not None and limit > total:
        raise ValueError(f"host_memory_limit={given!r} ({format_bytes(limit)}) is more than this "
                         f"machine's RAM ({format_bytes(total)}); pass at most that, or None "
                         f"(half the RAM available)")


def _fraction(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number between 0 and 1; got {value!r}")
    return float(value)

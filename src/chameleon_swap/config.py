"""Size parsing and the engine's validated configuration.

Nothing here touches a torch device: this module only turns user input into checked numbers and
names, so every bad argument fails before any memory is allocated or hook installed.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
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

POLICIES = ("guard",)


def parse_size(value: SizeLike, name: str = "size", *, allow_none: bool = True) -> Optional[int]:
    """Parse ``value`` into a number of bytes.

    Accepts a non-negative int, a finite non-negative float (rounded down to whole bytes) or a
    string with an optional unit (``"512MB"``, ``"1.5GiB"``, ``"4096"``). ``None`` passes through
    when ``allow_none``. Errors name the argument (``name``) and the accepted forms.
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
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be {_ACCEPTED}; got {value!r}")
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name} must be {_ACCEPTED}; could not parse {value!r}")
        number = float(m.group(1))
        result = number * _UNITS[m.group(2).lower()]
        if not math.isfinite(result):
            raise ValueError(f"{name} must be {_ACCEPTED}; {value!r} is too large")
        return int(result)
    raise TypeError(f"{name} must be {_ACCEPTED}; got {type(value).__name__} {value!r}")


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


@dataclass
class EngineConfig:
    """Validated arguments of :class:`chameleon_swap.Chameleon`."""

    budget: SizeLike = None
    min_tensor_bytes: SizeLike = DEFAULT_MIN_TENSOR_BYTES
    device_memory_limit: SizeLike = None
    policy: str = "guard"
    host_memory_limit: SizeLike = None

    def __post_init__(self) -> None:
        self.budget_bytes = parse_size(self.budget, "budget")
        self.min_tensor_bytes = parse_size(self.min_tensor_bytes, "min_tensor_bytes", allow_none=False)
        self.device_memory_limit_bytes = parse_size(self.device_memory_limit, "device_memory_limit")
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(repr(p) for p in POLICIES)}; "
                             f"got {self.policy!r}")
        limit = parse_size(self.host_memory_limit, "host_memory_limit")
        if limit is None:
            avail = available_host_memory()
            limit = int(avail * DEFAULT_HOST_FRACTION) if avail else 8 * 2**30
        self.host_memory_limit_bytes = limit

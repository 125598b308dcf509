"""Hardware profiles: what a device can compute, hold and copy, as data files.

Built-in profiles live in ``sim/hardware/<name>.json``, one per device, each figure with its source
(a vendor datasheet) or marked as an assumption. A user profile is any JSON file with the same
fields, passed by path. Peak FLOP/s are dense (datasheets often print the 2:4-sparsity figure,
twice as high); the ``*_fraction`` fields turn peaks into what real kernels reach.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Optional, Union

SCHEMA = 1
DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass(frozen=True)
class Hardware:
    name: str
    title: str
    device_memory_bytes: int
    peak_flops: dict                   # dtype -> dense FLOP/s
    achievable_fraction: float         # of peak FLOP/s, for matmuls
    memory_bandwidth_bytes_per_s: float
    memory_fraction: float             # of peak HBM bandwidth, for memory-bound kernels
    h2d_bytes_per_s: float             # nominal host -> device link rate, one direction
    d2h_bytes_per_s: float
    link_fraction: float               # of the nominal link rate that copies reach
    interconnect_bytes_per_s: float    # device <-> device (tensor parallelism), one direction
    interconnect_fraction: float
    host_memory_bytes: int
    reserved_bytes: int = 0            # runtime context, allocator slack: never for the model
    link_name: str = ""
    interconnect_name: str = ""
    sources: dict = field(default_factory=dict)
    confidence: str = ""
    # Measured pinned copy rates, one direction each; they replace nominal x link_fraction.
    measured_h2d_bytes_per_s: Optional[float] = None
    measured_d2h_bytes_per_s: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("device_memory_bytes", "memory_bandwidth_bytes_per_s", "h2d_bytes_per_s",
                     "d2h_bytes_per_s", "interconnect_bytes_per_s", "host_memory_bytes"):
            _positive(getattr(self, name), f"{self.name}: {name}")
        for name in ("achievable_fraction", "memory_fraction", "link_fraction",
                     "interconnect_fraction"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ValueError(f"{self.name}: {name} must be a number in (0, 1]; got {v!r}")
        if not isinstance(self.peak_flops, dict) or not self.peak_flops:
            raise ValueError(f"{self.name}: peak_flops must map dtypes ({', '.join(DTYPE_BYTES)}) "
                             f"to dense FLOP/s; got {self.peak_flops!r}")
        for k, v in self.peak_flops.items():
            if k not in DTYPE_BYTES:
                raise ValueError(f"{self.name}: peak_flops has unknown dtype {k!r}; accepted: "
                                 f"{', '.join(DTYPE_BYTES)}")
            _positive(v, f"{self.name}: peak_flops[{k!r}]")
        for name in ("measured_h2d_bytes_per_s", "measured_d2h_bytes_per_s"):
            if getattr(self, name) is not None:
                _positive(getattr(self, name), f"{self.name}: {name}")
        if not (isinstance(self.reserved_bytes, int) and self.reserved_bytes >= 0):
            raise ValueError(f"{self.name}: reserved_bytes must be an int >= 0; "
                             f"got {self.reserved_bytes!r}")

    # What kernels and copies reach, the figures the simulator times with.
    def flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(f"hardware {self.name!r} has no peak FLOP/s for dtype {dtype!r}; "
                             f"choose from {', '.join(sorted(self.peak_flops))}")
        return self.peak_flops[dtype] * self.achievable_fraction

    @property
    def memory_bytes_per_s(self) -> float:
        return self.memory_bandwidth_bytes_per_s * self.memory_fraction

    @property
    def d2h(self) -> float:
        if self.measured_d2h_bytes_per_s:
            return self.measured_d2h_bytes_per_s
        return self.d2h_bytes_per_s * self.link_fraction

    @property
    def h2d(self) -> float:
        if self.measured_h2d_bytes_per_s:
            return self.measured_h2d_bytes_per_s
        return self.h2d_bytes_per_s * self.link_fraction

    @property
    def interconnect(self) -> float:
        return self.interconnect_bytes_per_s * self.interconnect_fraction

    @property
    def usable_bytes(self) -> int:
        """Device memory the model may use (model states, activations, workspace)."""
        return self.device_memory_bytes - self.reserved_bytes

    @classmethod
    def from_dict(cls, d: dict, origin: str = "profile") -> "Hardware":
        if not isinstance(d, dict):
            raise ValueError(f"{origin}: a hardware profile is a JSON object; got {type(d).__name__}")
        if d.get("schema") != SCHEMA:
            raise ValueError(f"{origin}: hardware profile schema must be {SCHEMA}; "
                             f"got {d.get('schema')!r}")
        required = ("name", "device_memory_bytes", "peak_flops", "memory_bandwidth_bytes_per_s",
                    "host_link", "host_memory_bytes")
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"{origin}: hardware profile lacks {', '.join(missing)} "
                             f"(required: {', '.join(required)})")
        link = d["host_link"]
        inter = d.get("interconnect") or {}
        measured = link.get("measured") if isinstance(link, dict) else None
        if measured is not None and (not isinstance(measured, dict) or not {
                "h2d_bytes_per_s", "d2h_bytes_per_s", "source"} <= set(measured)):
            raise ValueError(f"{origin}: host_link.measured must be an object with "
                             f"h2d_bytes_per_s, d2h_bytes_per_s and source (device, date, how)")
        if not isinstance(link, dict) or "h2d_bytes_per_s" not in link or "d2h_bytes_per_s" not in link:
            raise ValueError(f"{origin}: host_link must be an object with h2d_bytes_per_s and "
                             f"d2h_bytes_per_s (one direction each)")
        try:
            return cls(name=str(d["name"]), title=str(d.get("title", d["name"])),
                       device_memory_bytes=int(d["device_memory_bytes"]),
                       peak_flops={k: float(v) for k, v in d["peak_flops"].items()},
                       achievable_fraction=float(d.get("achievable_fraction", 0.5)),
                       memory_bandwidth_bytes_per_s=float(d["memory_bandwidth_bytes_per_s"]),
                       memory_fraction=float(d.get("memory_fraction", 0.8)),
                       h2d_bytes_per_s=float(link["h2d_bytes_per_s"]),
                       d2h_bytes_per_s=float(link["d2h_bytes_per_s"]),
                       link_fraction=float(link.get("achievable_fraction", 1.0)),
                       interconnect_bytes_per_s=float(inter.get("bytes_per_s", link["h2d_bytes_per_s"])),
                       interconnect_fraction=float(inter.get("achievable_fraction", 1.0)),
                       host_memory_bytes=int(d["host_memory_bytes"]),
                       reserved_bytes=int(d.get("reserved_bytes", 0)),
                       link_name=str(link.get("name", "")),
                       interconnect_name=str(inter.get("name", "")),
                       sources=dict(d.get("sources", {})),
                       confidence=str(d.get("confidence", "")),
                       measured_h2d_bytes_per_s=float(measured["h2d_bytes_per_s"])
                       if measured else None,
                       measured_d2h_bytes_per_s=float(measured["d2h_bytes_per_s"])
                       if measured else None)
        except (TypeError, AttributeError) as exc:
            raise ValueError(f"{origin}: malformed hardware profile ({exc})") from exc


def _positive(v, name: str) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive number; got {v!r}")


def builtin_names() -> list[str]:
    folder = resources.files("chameleon_swap.sim") / "hardware"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def load(name_or_path: Union[str, Path], arg: str = "hardware") -> Hardware:
    """A built-in profile by name (``h100-sxm``), or a user profile from a JSON file path."""
    text: Optional[str] = None
    s = str(name_or_path)
    if s in builtin_names():
        text = (resources.files("chameleon_swap.sim") / "hardware" / f"{s}.json").read_text()
        origin = f"built-in profile {s!r}"
    elif s.endswith(".json") or Path(s).is_file():
        p = Path(s)
        if not p.is_file():
            raise ValueError(f"{arg}: no such file {s!r}")
        text, origin = p.read_text(), str(p)
    else:
        raise ValueError(f"{arg} must be a built-in profile ({', '.join(builtin_names())}) or the "
                         f"path of a JSON profile; got {s!r}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{arg}: {origin} is not valid JSON ({exc})") from exc
    return Hardware.from_dict(data, origin)

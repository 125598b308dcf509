"""chameleon-swap: keep a PyTorch training step's saved activations under a device-memory budget.

Saved activations move to host memory and back, overlapped with compute, in eager mode, with
every loss and gradient bit-for-bit what the same code computes without the engine. The method is
Chameleon (arXiv 2509.11076).
"""
from importlib import import_module

from ._version import __version__
from .config import format_bytes, parse_size

# Imported on first use (PEP 562): torch takes seconds to import, and the command line's
# --version, --help and usage errors, which never need it, should answer at once.
_LAZY = {"Chameleon": ".engine", "StepStats": ".runtime.stats", "HostMemoryError": ".copy.host_pool"}

__all__ = ["Chameleon", "StepStats", "HostMemoryError", "parse_size", "format_bytes", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))

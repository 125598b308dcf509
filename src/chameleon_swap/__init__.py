"""chameleon-swap: keep a PyTorch training step's saved activations under a device-memory budget.

Saved activations move to host memory and back, overlapped with compute, in eager mode, with
every loss and gradient bit-for-bit what the same code computes without the engine. The method is
Chameleon (arXiv 2509.11076).
"""
from ._version import __version__
from .config import format_bytes, parse_size
from .copy.host_pool import HostMemoryError
from .engine import Chameleon, StepStats

__all__ = ["Chameleon", "StepStats", "HostMemoryError", "parse_size", "format_bytes", "__version__"]

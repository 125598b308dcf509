"""Public path of weight offload (documented in the README); the code is in ``parallel/``."""
from .parallel.weights import WeightOffload

__all__ = ["WeightOffload"]

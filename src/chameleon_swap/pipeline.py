"""Public path of the pipeline API (documented in the README); the code is in ``parallel/``."""
from .parallel.pipeline import PipelineChameleon, ScheduleChronos

__all__ = ["PipelineChameleon", "ScheduleChronos"]

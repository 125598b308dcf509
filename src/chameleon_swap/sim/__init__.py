"""Scale by simulation: will a model fit a device at a budget, with which policy, how fast?

* ``trace``: the versioned JSON trace format (recorded by the profiler or generated analytically);
* ``hardware``: device profiles as data files (``sim/hardware/*.json``) or user files;
* ``models`` and ``analytic``: decoder-only transformer configurations and their analytic traces;
* ``policies``: every policy (none, recomputation, swapping, guard, static, chameleon) on the
  timeline model the planner uses, with the physical lower bound of each step;
* ``commands``: what ``chameleon-swap simulate | capacity | compare | trace`` run.

Nothing here imports torch except recording a trace from a real run.
"""
from .analytic import generate
from .hardware import Hardware, builtin_names
from .hardware import load as load_hardware
from .models import PRESETS, ModelConfig, preset
from .policies import POLICIES, Result, run
from .trace import FORMAT, VERSION, Step, Tensor, Trace, load, save

__all__ = ["generate", "Hardware", "builtin_names", "load_hardware", "PRESETS", "ModelConfig",
           "preset", "POLICIES", "Result", "run", "FORMAT", "VERSION", "Step", "Tensor", "Trace",
           "load", "save"]

"""Scale by simulation: will a model fit a device at a budget, with which policy, how fast?

* ``trace``: the versioned JSON trace format (recorded by the profiler or generated analytically);
* ``hardware``: device profiles as data files (``sim/hardware/*.json``) or user files;
* ``models`` and ``analytic``: decoder-only transformer configurations and their analytic traces;
* ``policies``: every policy (none, recomputation, swapping, guard, static, chameleon, hybrid) on the
  timeline model the planner uses, with the physical lower bound of each step;
* ``fake_trace``, ``hf_trace``, ``dit_trace``: a model's own step traced on fake tensors (a
  Hugging Face config, the video DiT), the bytes its code saves instead of a formula;
* ``gpu_steps``: simulated step times of traced models beside step times measured on a GPU;
* ``recovery`` (and ``recovery_cli``): after ranks are lost, rerouting, reconfiguration or
  either with the engine's budget re-planned per rank, chosen over a horizon (``recover``);
  ``restart``: at each (re)start of an elastic run, the layout, mode and per-rank budget for the
  world size torchrun gives (``examples/elastic_train.py`` applies it);
* ``commands`` (and ``hf_commands`` for ``--hf``): what ``chameleon-swap simulate | capacity |
  compare | trace`` run.

Nothing here imports torch except recording a trace from a real run or tracing a model.

May import: anything below the engine (``config``, ``copy/``, ``planning/``, ``runtime/``'s trace
format, ``parallel/``'s schedules) and ``bench/``/``workloads/`` to trace real models.
Imported by: ``cli.py`` only.
"""
from .analytic import generate
from .hardware import Hardware, builtin_names
from .hardware import load as load_hardware
from .models import PRESETS, ModelConfig, preset
from .policies import POLICIES, Result, run
from ..runtime.trace import FORMAT, VERSION, Step, Tensor, Trace, load, save

__all__ = ["generate", "Hardware", "builtin_names", "load_hardware", "PRESETS", "ModelConfig",
           "preset", "POLICIES", "Result", "run", "FORMAT", "VERSION", "Step", "Tensor", "Trace",
           "load", "save"]

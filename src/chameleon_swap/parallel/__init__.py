"""Pipelines and other layouts over several ranks: ``PipelineChameleon`` and the Chronos V order
(``pipeline.py``), pipeline schedules as data, timed under a cost model (``schedules.py``, no
torch), weight offload inside a step (``weights.py``), and recovery from a lost rank under
torchrun with DCP checkpoints (``elastic.py``; it takes the planner's answer as plain data and
builds each rank's ``Chameleon`` from it).

May import: ``engine.py`` (each rank runs a ``Chameleon``), ``recompute/``, ``copy/``,
``runtime/``, ``config``.
Imported by: the public re-exports ``chameleon_swap.pipeline``, ``chameleon_swap.weights`` and
``chameleon_swap.elastic``,
``sim/`` (schedules only), ``workloads/``, ``bench/``.
"""

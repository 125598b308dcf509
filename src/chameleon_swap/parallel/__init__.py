"""Pipelines and other layouts over several ranks: ``PipelineChameleon`` and the Chronos V order
(``pipeline.py``), pipeline schedules as data, timed under a cost model (``schedules.py``, no
torch), and weight offload inside a step (``weights.py``).

May import: ``engine.py`` (each rank runs a ``Chameleon``), ``recompute/``, ``copy/``,
``runtime/``, ``config``.
Imported by: the public re-exports ``chameleon_swap.pipeline`` and ``chameleon_swap.weights``,
``sim/`` (schedules only), ``workloads/``, ``bench/``.
"""

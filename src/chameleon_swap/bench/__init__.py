"""Benchmark harness: workloads x baselines x budgets, side by side, with bitwise loss checks.

* ``baselines.py``: the ways to fit activations that are compared (no engine, recompute, peers'
  offloading, the engine's policies);
* ``harness.py``: runs them on a workload's schedule and makes one record per run;
* ``meter.py``: device memory of a step on any device, CPU included;
* ``report.py``: markdown tables and figures; ``sweep.py`` and ``demo.py``: the commands' work.

May import: ``engine.py`` (the object it benchmarks), ``config``, ``copy/``, ``workloads/``.
Imported by: ``cli.py`` and ``sim/``.
"""

"""Mechanism of recomputation: finding a model's repeated blocks (``blocks.py``), running each
block call kept, selectively or fully checkpointed (``runner.py``), and what selective
checkpointing keeps (``selective.py``). It never chooses a mode: the runner asks the policy
(``policy/block_modes.py``) at every block call.

May import: ``config`` and ``runtime/`` (eager-mode helpers, the profiler's clock).
Imported by: ``engine.py`` (wiring, when ``model=`` is given), ``parallel/``, and the tools
above them.
"""

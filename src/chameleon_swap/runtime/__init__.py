"""What runs inside a training step: the mechanism that carries a saved tensor from pack to unpack.

Owns the saved-tensor hooks and the executor (``executor.py``: storage records, dedup by storage
object, view rebuild, version checks, residency accounting; it carries out moves and decides
none), the books (``records.py``), the lean hooks of an engine that can never move
(``resident.py``), the global module hooks (``module_hooks.py``), the step's end
(``step_end.py``), Ctrl-C safety in finalizers (``interrupts.py``), the always-on profiler
(``profiler.py``), ``StepStats`` and the history (``stats.py``) and the step trace format
(``trace.py``).

May import: ``config``, ``copy/`` (to move bytes) and ``planning/`` (its data types: profiles,
spans, signatures). Never ``policy/``: what to move is decided there and handed in.
Imported by: ``engine.py``, ``policy/``, ``recompute/``, ``parallel/``, and the tools above them.
"""

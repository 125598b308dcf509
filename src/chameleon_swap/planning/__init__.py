"""What decides, and only decides: pure functions from a measured step to a plan. No torch.

Owns the cost model of one step (``timeline.py``, run by ``timeline_run.py``), shared by the
planner and the simulator; the swap search (``swaps.py``: which tensors go out, when each comes
back); the block-mode search (``modes.py``: keep, selective or full per block, with the swaps
under them, and ``quiet.py``: the fastest mix that moves nothing, for figures not trusted yet);
operator-sequence signatures and similarity (``signatures.py``); and compiled plans
with their LRU cache (``cache.py``).

May import: nothing of the package outside ``planning/``, and not torch, so every plan can be
made and checked without a device (a test holds this).
Imported by: ``runtime/`` (data types only), ``policy/`` (to plan), ``sim/``, ``bench/``.
"""

"""Recompute mechanism: find a model's repeated blocks and run each block call in one of three modes.

* keep: the block's own forward; everything it saves goes through the engine's saved-tensor hooks.
* full: the forward runs without recording a graph, and backward runs the block again
  (``full.py``: an autograd Function, 4% cheaper a step than non-reentrant checkpoint on the
  demo's Llama). Only the call's inputs are saved, through the engine's pack hook, so they may be
  swapped like any other saved tensor. Tensors passed in keyword arguments (or in tuples) are
  handed over as positional inputs, so they are saved through the hooks too instead of hiding in
  a closure.
* selective: non-reentrant ``torch.utils.checkpoint`` with selective checkpointing that keeps the
  outputs of matmuls and attention and recomputes the rest. The call's inputs are saved outside
  checkpoint's own hook (``_CheckpointFrame.save_inputs`` runs before ``_checkpoint_hook`` is
  entered), so they reach the engine's pack hook as in full. Checkpointing keeps the kept outputs
  in its own storage, which the engine's hooks never see: their bytes are *held* on the
  accountant until the block's recompute ends.

Which mode a call runs is not decided here: ``mode_fn(block_index)`` is asked for each call.
Recompute runs the same code on the same inputs with the RNG state and autocast state of the
forward (restored by checkpoint, and by ``full.py``), so gradients are bit-for-bit those of the
plain step. A block with the user's own checkpointing inside is left as the user wrote it (always
keep): found from ``gradient_checkpointing`` flags (transformers) on the block, inside it or above
it, and at run time when a module inside the block starts under other saved-tensor hooks than the
block did (a non-reentrant checkpoint or ``save_on_cpu`` of the user's). A reentrant checkpoint
saves nothing inside and is not seen: nested in a full block, the block's backward meets it and
accumulates as it does from then on (``full.py``); nested in a selective block it stays correct,
it only recomputes twice. Inside a full block, the user's non-reentrant checkpoint is found in the
block's first recompute (its forward runs under no_grad, where checkpoint pushes no hooks).

Limits: a selective block can be backwarded once per forward (torch's selective checkpointing
refuses a second backward with ``retain_graph``; full blocks recompute again). A kept output that
is also saved through the hooks later (a block ending in a matmul whose output the next block
saves) is counted twice: too much, never too little. Under ``torch.compile`` tracing, blocks run
plainly.

Why one file (over 400 lines): the three modes share one block call wrapper, one RNG capture and
one set of entries in the executor's books (kept outputs, working sets); a mode split into its own
module would reach back into the wrapper's state.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from . import full, selective
from .blocks import find_blocks
from ..runtime.profiler import _CpuClock
from ..runtime._eager import is_compiling as _is_compiling
from ..runtime._eager import top_saved_hooks as _top_hooks

log = logging.getLogger("chameleon_swap")

MODES = ("keep", "selective", "full")
__all__ = ["MODES", "BlockCall", "BlockRunner", "find_blocks"]

# Keyword arguments through which a block updates a KV cache: recomputing such a call would update
# the cache twice, so those calls run keep. (transformers 5.24's decoder layers take it as
# ``cache``; earlier releases as ``past_key_value(s)``.)
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")



def _cache_off(model: nn.Module) -> Optional[bool]:
    """A Hugging Face model in training with ``config.use_cache`` on passes a KV cache to every
    layer, and a block called with a cache must run keep (a recompute would append to the cache
    twice). Training never reads that cache, so, as transformers does itself when gradient
    checkpointing is on, the cache is turned off for the step: ``use_cache`` is set False and the
    value it had is returned for ``end_step`` to put back (None: nothing changed). The loss and
    gradients are the same bits: the attention reads the same keys and values either way."""
    cfg = getattr(model, "config", None)
    if not model.training or getattr(cfg, "use_cache", None) is not True:
        return None
    if not _CACHE_NOTED:
        _CACHE_NOTED.append(True)
        log.info("chameleon-swap: use_cache=True is turned off during training steps so that "
                 "blocks can be recomputed (as transformers does with gradient checkpointing)")
    cfg.use_cache = False
    return True


_CACHE_NOTED: list = []


# --------------------------------------------------------------------------- what ran
@dataclass
class BlockCall:
    """One call of one block during a step, as it ran."""
    block: int                 # index into BlockRunner.blocks
    mode: str                  # the mode that ran (keep for ineligible blocks and KV-cache calls)
    input_bytes: int           # distinct storage bytes of the call's tensor args/kwargs
    first_record: int          # index_fn() at block entry and exit: the records saved inside the
    end_record: int            #   call through the engine's hooks are [first_record, end_record)
    forward_seconds: Optional[float] = None     # detailed steps only
    recompute_seconds: Optional[float] = None   # when it was recomputed in backward
    selective_bytes: int = 0   # bytes kept by selective checkpointing (held)
    recomputed_bytes: int = 0  # bytes held for the recompute working set (working_set_fn)
    # A full call's recompute, counted where ``count_kept_fn`` asked: what it saved (distinct
    # storages, parameters aside, its inputs added), so what the block saves kept, and how many
    kept_bytes: int = 0
    kept_saves: int = 0


class _Live:
    """A checkpointed call's outstanding holds and recompute marks during its step."""
    __slots__ = ("call", "step", "device", "seen", "sel_tokens", "ws_token", "__weakref__")

    def __init__(self, call: BlockCall, step: int, device: Optional[torch.device]) -> None:
        self.call, self.step, self.device = call, step, device
        self.seen: Optional[weakref.WeakSet] = weakref.WeakSet()   # storages held (forward only)
        self.sel_tokens: list = []
        self.ws_token = None


# --------------------------------------------------------------------------- the runner
class BlockRunner:
    """Run each call of ``blocks`` (see ``find_blocks``) in the mode ``mode_fn(block_index)``
    returns, between ``begin_step`` and ``end_step``, once ``install()`` wrapped their forwards.

    Args:
        mode_fn: ``mode_fn(block_index) -> str`` in ``MODES``, asked at each call made while a step
            is active and grad is enabled, for eligible blocks only (ineligible blocks and calls
            that carry a KV cache run keep, unasked). Otherwise the block runs plainly.
        accountant: ``hold(nbytes) -> token`` and ``release_hold(token)`` (or ``release(token)``):
            counts bytes the engine's saved-tensor hooks cannot see (an ``Executor``); with
            ``try_hold(nbytes) -> token or None`` too, an output selective checkpointing would
            keep where it has no room is recomputed instead (``_keep_out``).
        clock: ``mark() -> marker`` and ``seconds(markers) -> list[float]`` (the profiler's
            clocks); None: ``time.perf_counter``.
        index_fn: ``() -> int``, the accountant's next record index; None reads
            ``accountant.next_index``.
        apart_fn: ``() -> (waits, seconds)``, where the step's time apart from compute stands
            (the profiler's ``apart_mark``): read around each recompute, the waits between the
            two reads (their seconds given to ``end_step``) and the seconds between them are
            taken out of the recompute's time. None: nothing taken out.

    ``working_set_fn(block_index) -> int`` (None: 0) gives the bytes to hold while a block's
    recompute and backward run; the hold starts with the recompute and ends when the gradient of
    the call's first grad-requiring non-leaf input is ready, else at the next block's recompute,
    else at ``end_step``.
    """

    def __init__(self, model: nn.Module, blocks=None, *, mode_fn: Callable[[int], str],
                 accountant, clock=None, index_fn: Optional[Callable[[], int]] = None,
                 apart_fn: Optional[Callable[[], tuple]] = None) -> None:
        self.blocks = find_blocks(model, blocks)
        if not callable(mode_fn):
            raise TypeError(f"mode_fn must be a callable block_index -> one of {MODES}; "
                            f"got {type(mode_fn).__name__}")
        release = getattr(accountant, "release_hold", None) or getattr(accountant, "release", None)
        if not callable(getattr(accountant, "hold", None)) or not callable(release):
            raise TypeError("accountant must have hold(nbytes) -> token and release_hold(token) "
                            f"(or release(token)); got {type(accountant).__name__}")
        if index_fn is None:
            if not hasattr(accountant, "next_index"):
                raise TypeError("index_fn must be a callable () -> int when the accountant has "
                                "no next_index attribute")
            index_fn = lambda: accountant.next_index  # noqa: E731
        elif not callable(index_fn):
            raise TypeError(f"index_fn must be a callable () -> int or None; got "
                            f"{type(index_fn).__name__}")
        self.model = model
        self.mode_fn = mode_fn
        self.working_set_fn: Optional[Callable[[int], int]] = None
        # () -> whether full calls' recomputes count what they save (``BlockCall.kept_bytes``)
        self.count_kept_fn: Optional[Callable[[], bool]] = None
        # (forward) -> a context in which the caller's global module hooks step aside while a
        # full block runs (the engine's ``module_hooks.Quiet``); None: they stay, and every
        # recompute after a block's first at a shape is walked only where it reached leaves.
        self.quiet_hooks: Optional[Callable[[bool], Any]] = None
        self.input_bytes = 0                # the running call's input bytes (set before mode_fn)
        self._hold, self._release, self._index = accountant.hold, release, index_fn
        # (an accountant with room to refuse: the executor's; a selective output it refuses is
        # recomputed, not kept)
        self._try_hold = getattr(accountant, "try_hold", None)
        self.clock = clock if clock is not None else _CpuClock()
        self.apart_fn = apart_fn
        names = {id(m): n for n, m in model.named_modules()}
        # Modules on the path from the model to each block: a gradient_checkpointing flag there
        # (older transformers set it on the decoder, not on its layers) checkpoints the block too.
        ancestors = [[model.get_submodule(".".join(names[id(b)].split(".")[:k]))
                      for k in range(names[id(b)].count(".") + 1)] for b in self.blocks]
        self._user_ckpt = [False] * len(self.blocks)   # seen checkpointing inside, at run time
        self._reentrant: set[int] = set()     # blocks whose full backward met a reentrant one
        self._foreign: dict[int, list] = {}    # leaves blocks reach that are not theirs (full.py)
        self._walked: set[tuple] = set()       # (block, its inputs' shapes) walked
        self._members = [{id(m) for m in b.modules()} for b in self.blocks]
        self._outside: Optional[list] = None   # modules not the block's its recompute called
        self._create_graph = False     # a full backward ran under create_graph (full.py)
        # Per block: whether selective checkpointing can run it (selective.MutationWatch, on
        # its first call run kept; None: not known yet). A block asked to run selective where
        # it is known not to be runs full; the policy asks only where it is known to be (it
        # holds this list: changed in place).
        self.selective_safe: list[Optional[bool]] = [None] * len(self.blocks)
        # Where a gradient_checkpointing flag can be read each step: the ancestors and the block
        # itself always, inside it the modules that have the attribute now (transformers' layers
        # and models declare it). Walking every module of every block at each step's start cost
        # 0.2 ms a step on the demo's 8-block Llama; an inner module that gains the attribute
        # later is still caught at run time by the probe if its checkpoint is non-reentrant, and a
        # reentrant one nested in ours stays correct (see the module's docstring).
        self._flags = [[*ancestors[i], b] + [m for m in b.modules() if m is not b
                                                   and hasattr(m, "gradient_checkpointing")]
                       for i, b in enumerate(self.blocks)]
        self.eligible: list[bool] = []
        self._refresh_eligible()
        self._saved: dict[int, tuple] = {}           # block index -> (wrapper, previous attr)
        self._probe_handle = None
        self._probe: Optional[tuple] = None    # (block index, hooks on top, recomputes) at entry
        self._recomputes = 0
        self._active = self._detailed = False
        self.lean, self.lean_calls = False, 0     # the engine's lean path (block calls past it)
        self._step = 0
        self._depth = 0
        # > 0 while a checkpointed block's forward runs: what it saves goes to checkpoint, never
        # through the engine's hooks, so its modules' calls tell the engine nothing.
        self.quiet = 0
        self._calls: list[BlockCall] = []
        self._live: list[_Live] = []
        self._open_ws: list[_Live] = []
        self._timed: list[tuple] = []        # (call, "forward"|"recompute", start, end, apart)
        self._cache_was: Optional[bool] = None       # use_cache turned off for this step

    @property
    def in_step(self) -> bool:
        """Between begin_step() and end_step()."""
        return self._active

    @property
    def recomputing(self) -> bool:
        """True while a block's recompute forward runs (in backward)."""
        return self._recomputes > 0

    def _refresh_eligible(self) -> None:
        # In place: a caller holding the list sees it change.
        self.eligible[:] = [not self._user_ckpt[i] and not any(
            getattr(m, "gradient_checkpointing", False) is True for m in self._flags[i])
            for i in range(len(self.blocks))]

    # ------------------------------------------------------------------ install / remove
    def install(self, probe: bool = True) -> None:
        """Wrap each block's forward (an instance attribute over the class's); idempotent.
        ``probe=False``: no global module pre-hook of the runner's own; the caller's calls
        ``probe(module)`` before every module call instead (the engine's does: every global hook
        sends every module call in the process through torch's slower call path)."""
        for i, b in enumerate(self.blocks):
            if i not in self._saved:
                prev = b.__dict__.get("forward", _MISSING)
                wrapper = _wrap(self, i, b.forward)
                b.__dict__["forward"] = wrapper
                self._saved[i] = (wrapper, prev)
        if probe and self._probe_handle is None and _top_hooks is not None:
            ref = weakref.ref(self)
            self._probe_handle = nn.modules.module.register_module_forward_pre_hook(
                lambda module, args: _probe(ref, module))

    def remove(self) -> None:
        """Put back exactly the forwards ``install`` found (a forward someone else set over ours
        since is left alone); idempotent."""
        for i, (wrapper, prev) in self._saved.items():
            d = self.blocks[i].__dict__
            if d.get("forward") is wrapper:
                if prev is _MISSING:
                    del d["forward"]
                else:
                    d["forward"] = prev
        self._saved = {}
        if self._probe_handle is not None:
            self._probe_handle.remove()
            self._probe_handle = None

    def probe(self, module: nn.Module) -> None:
        """Before a module call: inside a block's call, a module that starts under other
        saved-tensor hooks than the block did (the user's own checkpoint) makes the block
        ineligible from then on; in a full block's recompute, a module not the block's is
        noted (``full.py``). Cheap where no block call is running."""
        if self._probe is None:
            return
        i, top, recomputes = self._probe
        if self._recomputes != recomputes:      # (another block's recompute, inside)
            return
        if self._outside is not None and id(module) not in self._members[i]:
            self._outside.append(module)        # (a full block's recompute: full.py)
        now = _top_hooks(False)
        if not (now is top or (now is not None and top is not None
                               and now[0] is top[0] and now[1] is top[1])):
            self._user_ckpt[i] = True
            self.eligible[i] = False

    def __enter__(self) -> "BlockRunner":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # ------------------------------------------------------------------ steps
    def begin_step(self, detailed: bool) -> None:
        if self._active:
            raise RuntimeError("BlockRunner.begin_step() was called twice without end_step()")
        self._step += 1
        self._active, self._detailed = True, bool(detailed)
        self._cache_was = _cache_off(self.model)
        # No block runs or recomputes between steps: counts an interrupt left unbalanced go.
        self._depth = self._recomputes = self.quiet = 0
        self.lean, self.lean_calls = False, 0
        self._outside = None
        self._refresh_eligible()     # the user may have turned gradient checkpointing on or off
        self._calls, self._timed = [], []

    def end_step(self, failed: bool, waits: Sequence[float] = ()) -> list[BlockCall]:
        """What ran this step. Releases every hold of this step still outstanding. Timings are
        read from the clock here (on CUDA, after the caller synchronized); none after a failure.
        ``waits``: the seconds of each of the step's waits for copies, in the order ``apart_fn``
        counted them; a recompute's time is without those that fell inside it, and without the
        moves' seconds inside it."""
        self._active = self.lean = False
        if self._cache_was is not None:
            self.model.config.use_cache, self._cache_was = self._cache_was, None
        for live in self._live:
            self._release_all(live)
        self._live, self._open_ws = [], []
        timed, self._timed = self._timed, []
        if not failed and timed:
            secs = self.clock.seconds([m for t in timed for m in t[2:4]])
            for k, (call, what, _, _, apart) in enumerate(timed):
                d = secs[2 * k + 1] - secs[2 * k]
                if what == "forward":
                    call.forward_seconds = d
                    continue
                if apart is not None:       # ((waits, moves) at its start, ... at its end)
                    (w0, m0), (w1, m1) = apart
                    d = max(0.0, d - sum(waits[w0:w1]) - (m1 - m0))
                call.recompute_seconds = (call.recompute_seconds or 0.0) + d
        calls, self._calls = self._calls, []
        return calls

    # ------------------------------------------------------------------ one call
    def _wants(self) -> bool:
        if not (self._active and self._depth == 0 and not self._recomputes
                and torch.is_grad_enabled() and not _is_compiling()):
            return False
        if self.lean:                # the engine's lean path: every block runs as written
            self.lean_calls += 1
            return False
        return True

    def _call(self, i: int, orig, args: tuple, kwargs: dict):
        mode = "keep"
        flat, rebuild = _flatten(args, kwargs)
        self.input_bytes = _storage_bytes(flat)      # what mode_fn may read: this call's size
        if self.eligible[i] and not any(kwargs.get(k) is not None for k in _CACHE_KWARGS):
            mode = self.mode_fn(i)
            if mode not in MODES:
                raise ValueError(f"mode_fn({i}) must return one of {MODES}; got {mode!r}")
            if mode == "selective" and self.selective_safe[i] is False:
                mode = "full"            # selective checkpointing would fail it in backward
        call = BlockCall(i, mode, self.input_bytes, self._index(), -1)
        self._calls.append(call)
        start = self.clock.mark() if self._detailed else None
        self._depth += 1
        try:
            if not self.eligible[i]:
                out = orig(*args, **kwargs)
            elif mode == "keep" and self.selective_safe[i] is None:
                with selective.MutationWatch() as watch:
                    out = self._probed(i, orig, args, kwargs)
                # Unsafe too where its output is a kept op's: a later block may write into it.
                self.selective_safe[i] = not (watch.unsafe or selective.aliases(watch.outputs,
                                                                                  out))
            elif mode == "keep":
                out = self._probed(i, orig, args, kwargs)
            else:
                out = self._checkpointed(i, orig, flat, rebuild, call)
        finally:
            self._depth -= 1
            call.end_record = self._index()
        if start is not None:
            self._timed.append((call, "forward", start, self.clock.mark(), None))
        return out

    def _probed(self, i: int, fn, args, kwargs):
        """Run ``fn`` with the saved-tensor hooks on top remembered, so that a module inside it
        that starts under other hooks (the user's own checkpoint) makes block ``i`` ineligible."""
        prev = self._probe
        self._probe = ((i, _top_hooks(False), self._recomputes) if _top_hooks is not None
                       else None)
        try:
            return fn(*args, **kwargs)
        finally:
            self._probe = prev

    def _checkpointed(self, i: int, orig, flat: list, rebuild, call: BlockCall):
        live = _Live(call, self._step, flat[0].device if flat else None)
        self._live.append(live)

        full_call = call.mode == "full" and not self._create_graph
        shapes = (i, *((t.shape, t.dtype) for t in flat)) if full_call else None
        # A full block's forward runs under no_grad, where the user's non-reentrant checkpoint
        # pushes no hooks: the probe finds nothing there. Its recompute is probed the first time
        # at a shape; after that, where the caller can take its module hooks out of the way,
        # the recompute runs without them (so without the probe) and its graph is walked
        # instead, which finds every leaf not the block's (``full.py``), a called module's too.
        aside = self.quiet_hooks if full_call else None
        hushed = aside is not None and shapes in self._walked

        def run(*tensors):
            a, k = rebuild(tensors)
            if self._recomputes:        # (the user's non-reentrant checkpoint pushes its
                # hooks only here, where full's are on top)
                if call.mode != "full":
                    return orig(*a, **k)
                if hushed:
                    with aside(False):
                        return orig(*a, **k)
                return self._probed(i, orig, a, k)
            self.quiet += 1
            try:
                if aside is not None:
                    with aside(True):
                        return orig(*a, **k)
                return self._probed(i, orig, a, k)
            finally:
                self.quiet -= 1

        if full_call:
            params = [p for p in self.blocks[i].parameters() if p.requires_grad]
            params += [t for t in self._foreign.get(i, ()) if t.requires_grad]
            out = full.FullCall(run, params, lambda: _Recompute(self, live, None, outside=True),
                                functools.partial(self._reentrant.add, i),
                                functools.partial(setattr, self, "_create_graph", True),
                                self._reached, functools.partial(self._found, shapes),
                                walk=hushed or i in self._foreign or shapes not in self._walked,
                                accumulate=i in self._reentrant).run(flat)
        else:
            forward_ctx, recompute_ctx = (selective.selective_contexts(functools.partial(
                self._keep_out, live)) if call.mode == "selective" else (contextlib.nullcontext(),
                                                                          None))
            ctx = _Recompute(self, live, recompute_ctx)
            out = checkpoint(run, *flat, use_reentrant=False, preserve_rng_state=True,
                             context_fn=lambda: (forward_ctx, ctx))
        live.seen = None
        for t in flat:
            if t.requires_grad and t.grad_fn is not None:
                # A hook on a leaf would outlive the step; on a non-leaf it dies with the graph.
                t.register_hook(functools.partial(_input_grad_ready, weakref.ref(self), live))
                break
        return out

    def _reached(self) -> list:
        """The parameters of the modules outside the block that its last recompute called."""
        mods, self._outside = self._outside or [], None
        return [p for m in mods for p in m.parameters() if p.requires_grad]

    def _found(self, shapes: tuple, leaves: list, walked: bool) -> None:
        """The backward of a full call of block ``shapes[0]`` (inputs of those shapes; its graph
        ``walked`` or not) reached ``leaves`` that are not the block's parameters: a full call
        passes them to its Function from then on, and every backward of the block is walked
        (``full.py``)."""
        if walked:
            self._walked.add(shapes)
        if leaves:
            have = self._foreign.setdefault(shapes[0], [])
            have += [t for t in leaves if not any(t is h for h in have)]

    def _keep_out(self, live: _Live, out) -> bool:
        """Hold the bytes of an output selective checkpointing would keep (once per storage);
        False where the accountant has no room for them (``try_hold``): checkpoint then
        recomputes it in backward, as it does the rest of the block, and the budget holds."""
        new: dict = {}
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if not isinstance(t, torch.Tensor) or live.seen is None:
                continue
            if live.device is not None and t.device != live.device:
                continue          # e.g. the RNG seed tensors flash attention returns on the host
            s = t.untyped_storage()
            n = s.nbytes()
            if n and s not in live.seen and s not in new:
                new[s] = n
        if not new:
            return True
        n = sum(new.values())
        token = (self._try_hold(n) if self._try_hold is not None and selective.can_decline()
                 else self._hold(n))
        if token is None:
            return False
        live.seen.update(new)
        live.sel_tokens.append(token)
        live.call.selective_bytes += n
        return True

    # ------------------------------------------------------------------ recompute and holds
    def _recompute_begins(self, live: _Live) -> tuple:
        for other in self._open_ws:
            self._release_ws(other)
        self._open_ws = []
        n = self.working_set_fn(live.call.block) if self.working_set_fn is not None else 0
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"working_set_fn({live.call.block}) must return bytes as an int "
                             f">= 0; got {n!r}")
        # The outputs selective checkpointing kept are part of what the block's backward needs:
        # the recompute re-creates only the rest, and the kept ones stay held until the
        # block's backward is done (they are consumed by it, not freed by the recompute).
        rest = max(0, n - live.call.selective_bytes)
        # checkpoint saved the call's inputs (counted as the records they are); the recompute
        # saves them again in place (a block's first operations save its inputs), so what it
        # re-creates beside them is the rest (as the planner's ``apply_modes`` counts it).
        rest = max(0, rest - live.call.input_bytes)
        if live.ws_token is None and live not in self._open_ws and (n or live.sel_tokens):
            if rest:
                live.ws_token = self._hold(rest)
            live.call.recomputed_bytes = n
            self._open_ws.append(live)
        return self.clock.mark(), self.apart_fn() if self.apart_fn is not None else None

    def _recompute_ends(self, live: _Live, start: tuple) -> None:
        mark, apart = start
        end = self.apart_fn() if apart is not None else None
        self._timed.append((live.call, "recompute", mark, self.clock.mark(),
                            None if end is None else (apart, end)))

    def _release_ws(self, live: _Live) -> None:
        """The block's backward is done: its working set and kept outputs are gone."""
        if live.ws_token is not None:
            token, live.ws_token = live.ws_token, None
            self._release(token)
        for token in live.sel_tokens:
            self._release(token)
        live.sel_tokens = []

    def _release_all(self, live: _Live) -> None:
        self._release_ws(live)


class _Recompute:
    """checkpoint's recompute context: marks the runner as recomputing, times the recompute and
    starts the block's working-set hold (only for a recompute inside the call's own step)."""

    def __init__(self, runner: BlockRunner, live: _Live, inner, outside: bool = False) -> None:
        self.runner, self.live, self.inner, self.start = runner, live, inner, None
        self.outside = outside          # (collect the modules outside the block it calls)

    def __enter__(self):
        r = self.runner
        r._recomputes += 1
        if self.outside:
            r._outside = []
        try:
            if r._active and self.live.step == r._step:
                self.start = r._recompute_begins(self.live)
                if self.outside and r.count_kept_fn is not None and r.count_kept_fn():
                    # (full.py's identity hooks are below: these take the recompute's saves)
                    self.inner = _Counting(self.live.call)
            if self.inner is not None:
                self.inner.__enter__()
        except BaseException:
            r._recomputes -= 1
            raise
        return self

    def __exit__(self, *exc) -> bool:
        r = self.runner
        try:
            if self.inner is not None:
                self.inner.__exit__(*exc)
        finally:
            r._recomputes -= 1
            if self.start is not None:
                start, self.start = self.start, None
                r._recompute_ends(self.live, start)
        return False


# --------------------------------------------------------------------------- helpers
_MISSING = object()


class _Counting(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that hand back what they get and count, on ``call``, the distinct
    storages saved that are not parameters (as the engine's pack counts a kept block's saves):
    the recompute of a full call saves what the call would have saved kept. Its inputs are
    saved as detached leaves here (the engine's pack would count them): added at once."""

    def __init__(self, call: BlockCall) -> None:
        self.seen: set = set()
        call.kept_bytes, call.kept_saves = call.input_bytes, 0

        def pack(t):
            base = t._base if t._base is not None else t
            if not (base.is_leaf and (base.requires_grad or isinstance(base, nn.Parameter))):
                st = t.untyped_storage()
                if st not in self.seen:
                    self.seen.add(st)
                    call.kept_bytes += st.nbytes()
                    call.kept_saves += 1
            return t
        super().__init__(pack, full._same)

    def __exit__(self, *exc) -> None:
        self.seen = set()                   # (the storages are the recompute's to free)
        super().__exit__(*exc)


def _wrap(runner: BlockRunner, i: int, orig):
    ref = weakref.ref(runner)

    @functools.wraps(orig)
    def forward(*args, **kwargs):
        r = ref()
        if r is None or not r._wants():
            return orig(*args, **kwargs)
        return r._call(i, orig, args, kwargs)
    return forward


def _probe(ref, module) -> None:
    r = ref()
    if r is not None:
        r.probe(module)


def _input_grad_ready(ref, live: _Live, grad) -> None:
    r = ref()
    if r is not None:
        r._release_ws(live)
        if live in r._open_ws:
            r._open_ws.remove(live)


class _Slot:
    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


def _flatten(args: tuple, kwargs: dict):
    """The tensors of a call (in args, kwargs values and tuples in them) and a function that
    rebuilds ``(args, kwargs)`` from them. Lists, dicts and other objects are passed as they are
    (a block may mutate them), their tensors included."""
    tensors: list[torch.Tensor] = []

    def split(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return _Slot(len(tensors) - 1)
        if type(x) is tuple:
            return tuple(split(v) for v in x)
        return x

    spec = (split(args), {k: split(v) for k, v in kwargs.items()})

    def fill(x, ts):
        if type(x) is _Slot:
            return ts[x.i]
        if type(x) is tuple:
            return tuple(fill(v, ts) for v in x)
        return x

    def rebuild(ts):
        return fill(spec[0], ts), {k: fill(v, ts) for k, v in spec[1].items()}
    return tensors, rebuild


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: list = []
    total = 0
    for t in tensors:
        s = t.untyped_storage()
        if not any(s is o for o in seen):
            seen.append(s)
            total += s.nbytes()
    return total

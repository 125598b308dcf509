"""Simulator steps from traced models: a Hugging Face config (or any module) run on fake tensors.

``trace_hf`` builds ``AutoModelForCausalLM.from_config`` under ``FakeTensorMode`` (no weights, no
device), runs one step at the user's settings (CPU autocast to bf16 with fp32 weights, or fp32;
SDPA attention by default, as transformers picks) and records it with ``fake_trace``. Deep models
are traced with ``TRACED_LAYERS`` layers and the middle layer repeated (``scale_layers``), only
when two middle layers were recorded identical; otherwise every layer is traced. Recordings are
cached on disk by a hash of what determines them, under ``$CHAMELEON_SWAP_CACHE``, else
``$XDG_CACHE_HOME/chameleon-swap``, else ``~/.cache/chameleon-swap``.

Fake CUDA tensors need a CUDA build of torch, so the step is traced with CPU kernels: autocast's
CPU op lists (matmuls in bf16, reductions in fp32, as on CUDA for a Llama) and the CPU
FlashAttention kernel, which saves what the CUDA one does (output and fp32 log-sum-exp).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional


TRACED_LAYERS = 4
OPTIMIZERS = {"sgd": 0, "adamw": 2}     # moments kept per parameter, in the parameter's dtype
CACHE_VERSION = 2     # 2: ops carry the bytes selective checkpointing keeps


@dataclass
class SavedTensor:
    nbytes: int               # the storage's bytes, once per storage
    dtype: str
    shape: tuple
    module: str               # path of the innermost module running when it was saved
    order: int                # save order among the step's distinct storages
    saved_at: int             # forward segment during which it was saved
    first_used_at: int = -1   # backward slot of its first unpack; -1: never unpacked
    input_of: tuple = ()      # the modules that took this storage as their first input


@dataclass
class Recording:
    """One step as the tracer saw it. ``segment_ops`` holds, per slot (forward segments then
    backward ones), the ops' ``(flops, bytes, low_precision, kept_bytes)`` (kept_bytes: the output
    bytes selective checkpointing keeps, 0 for ops it recomputes); ``segment_module`` the module path
    each slot belongs to ("" outside every module)."""
    segment_ops: list
    segment_module: list
    n_forward: int
    tensors: list                 # of SavedTensor, in save order
    skipped_bytes: Optional[int]  # parameters, buffers and views saved (None once scaled)
    param_bytes: int
    grad_bytes: int               # gradients of parameters the step left behind
    peak_bytes: Optional[int]     # most bytes allocated during the step at once (None once
                                  # scaled: the peak is not a sum of layers)
    transient_bytes: int          # most bytes at once that were neither saved nor gradients
    extra: dict = field(default_factory=dict)

    @property
    def activation_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["tensors"] = [dict(t.__dict__, shape=list(t.shape), input_of=list(t.input_of))
                        for t in self.tensors]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Recording":
        d = dict(d)
        d["tensors"] = [SavedTensor(**dict(t, shape=tuple(t["shape"]), input_of=tuple(t["input_of"])))
                        for t in d["tensors"]]
        d["segment_ops"] = [[tuple(op) for op in seg] for seg in d["segment_ops"]]
        return cls(**d)



def cache_dir() -> Path:
    if os.environ.get("CHAMELEON_SWAP_CACHE"):
        return Path(os.environ["CHAMELEON_SWAP_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "chameleon-swap"


def cached(key_parts: list, make: Callable[[], "Recording"], use_cache: bool) -> "Recording":
    """The recording of ``make()``, kept on disk under a hash of ``key_parts`` (JSON-able): read
    back when present (a stale or damaged entry is traced again), written atomically after."""
    key = hashlib.sha256(json.dumps([CACHE_VERSION, *key_parts], sort_keys=True,
                                    default=str).encode()).hexdigest()[:24]
    path = cache_dir() / f"trace-{key}.json"
    if use_cache and path.is_file():
        try:
            return Recording.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError, KeyError):
            pass
    rec = make()
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec.to_dict()))
        tmp.replace(path)
    return rec


# ----------------------------------------------------------------------------- layer scaling
def _block_of(module: str, prefix: str) -> Optional[int]:
    m = re.match(re.escape(prefix) + r"\.(\d+)(\.|$)", module)
    return int(m.group(1)) if m else None


def _chunks(blocks: list, n: int) -> Optional[list]:
    """[(start, end)] per block index 0..n-1 in ``blocks`` order, or None when the slots of a
    block are not one contiguous run between slots outside every block."""
    runs: list = []
    for i, b in enumerate(blocks):
        if b is None:
            continue
        if runs and runs[-1][0] == b and runs[-1][2] == i:
            runs[-1][2] = i + 1
        else:
            runs.append([b, i, i + 1])
    if len(runs) != n or sorted(r[0] for r in runs) != list(range(n)):
        return None
    spans = {b: (s, e) for b, s, e in runs}
    first, last = runs[0][1], runs[-1][2]
    if any(b is not None for b in blocks[:first] + blocks[last:]):
        return None
    return [spans[b] for b in range(n)]


def _rename(module: str, prefix: str, old: int, new: int) -> str:
    head = f"{prefix}.{old}"
    return f"{prefix}.{new}" + module[len(head):] if _block_of(module, prefix) == old else module


def scale_layers(rec: Recording, prefix: str, layers: int) -> Optional[Recording]:
    """``rec`` (a step of ``n >= 4`` identical blocks under ``prefix``) as a step of ``layers``
    blocks: the first and last traced blocks kept, the second repeated in between. None when the
    recording does not have that structure (blocks interleaved, the two middle ones different,
    or a middle block's tensor first used by another block)."""
    n = rec.extra.get("layers")
    if not n or n < 4 or layers < n:
        return None
    blocks = _Blocks.find(rec, prefix, n)
    if blocks is None or not blocks.repeatable():
        return None
    # Traced block -> the blocks it stands for in the scaled step.
    order = [0] + [1] * (layers - 2) + [n - 1]
    layout = _Layout(blocks, order)
    per_block = rec.extra["block_param_bytes"]
    extra = dict(rec.extra, layers=layers, traced_layers=n)
    return Recording(segment_ops=layout.ops, segment_module=layout.mods,
                     n_forward=layout.n_forward, tensors=layout.tensors(),
                     skipped_bytes=None, param_bytes=rec.param_bytes + (layers - n) * per_block,
                     grad_bytes=rec.grad_bytes + (layers - n) * per_block,
                     peak_bytes=None, transient_bytes=rec.transient_bytes, extra=extra)


class _Blocks:
    """Where the ``n`` blocks under ``prefix`` run in a recording: ``fwd[b]`` and ``bwd[b]``, the
    (start, end) slots of block ``b`` in forward and in backward."""

    def __init__(self, rec: Recording, prefix: str, n: int, fwd: list, bwd: list) -> None:
        self.rec, self.prefix, self.n, self.fwd, self.bwd = rec, prefix, n, fwd, bwd
        self.nf, self.slots = rec.n_forward, len(rec.segment_ops)

    @classmethod
    def find(cls, rec: Recording, prefix: str, n: int) -> Optional["_Blocks"]:
        """None when a block's slots are not one contiguous run, in forward or in backward."""
        nf = rec.n_forward
        fwd = _chunks([_block_of(m, prefix) for m in rec.segment_module[:nf]], n)
        bwd = _chunks([_block_of(m, prefix) for m in rec.segment_module[nf:]], n)
        if fwd is None or bwd is None:
            return None
        return cls(rec, prefix, n, fwd, [(s + nf, e + nf) for s, e in bwd])

    def where(self, slot: int):
        """(block, offset) of a slot; block None outside every block."""
        for b, (s, e) in enumerate(self.fwd if slot < self.nf else self.bwd):
            if s <= slot < e:
                return b, slot - s
        return None, slot

    def signature(self, b: int):
        """What block ``b`` runs and saves, with its index renamed to 0; None when a tensor it
        saves is first used by another block (it cannot be repeated then)."""
        rec, prefix, (f, k) = self.rec, self.prefix, (self.fwd[b], self.bwd[b])
        ops = [rec.segment_ops[i] for i in range(*f)] + [rec.segment_ops[i] for i in range(*k)]
        mods = [_rename(rec.segment_module[i], prefix, b, 0) for i in list(range(*f)) +
                list(range(*k))]
        ts = []
        for t in rec.tensors:
            if f[0] <= t.saved_at < f[1]:
                ub, off = (self.where(t.first_used_at) if t.first_used_at < self.slots
                           else ("never", 0))
                if ub not in (b, None, "never"):
                    return None               # used first by another block: cannot repeat it
                ts.append((t.nbytes, t.dtype, t.shape, _rename(t.module, prefix, b, 0),
                           tuple(_rename(m, prefix, b, 0) for m in t.input_of), t.saved_at - f[0],
                           ub == b, off if ub is not None else t.first_used_at))
        return ops, mods, ts

    def repeatable(self) -> bool:
        """The middle blocks are identical, and no tensor of another block (or outside every
        block) is first used by a middle one: which of the repeated blocks would use it is
        unknown."""
        n = self.n
        mid = self.signature(1)
        if mid is None or any(self.signature(b) != mid for b in range(2, n - 1)):
            return False
        for t in self.rec.tensors:
            sb = self.where(t.saved_at)[0]
            ub = self.where(t.first_used_at)[0] if t.first_used_at < self.slots else None
            if ub is not None and 0 < ub < n - 1 and sb != ub:
                return False
        return True


class _Layout:
    """The slots of the scaled step: traced block ``order[new]`` stands for block ``new``; slots
    outside every block keep their place before the blocks and shift by what the blocks grew
    after them. ``new_fwd[new]``, ``new_bwd[new]``: where block ``new`` starts."""

    def __init__(self, blocks: _Blocks, order: list) -> None:
        self.blocks, self.order = blocks, order
        rec, fwd, bwd, nf = blocks.rec, blocks.fwd, blocks.bwd, blocks.nf
        self.new_fwd, self.new_bwd, self.ops, self.mods = {}, {}, [], []
        for i in range(fwd[0][0]):
            self._emit(i, -1, -1)
        for new, old in enumerate(order):
            self.new_fwd[new] = len(self.ops)
            for i in range(*fwd[old]):
                self._emit(i, old, new)
        for i in range(fwd[-1][1], nf + (bwd[-1][0] - nf)):
            self._emit(i, -1, -1)
        self.n_forward = len(self.ops) - (bwd[-1][0] - nf)
        for new in reversed(range(len(order))):
            old = order[new]
            self.new_bwd[new] = len(self.ops)
            for i in range(*bwd[old]):
                self._emit(i, old, new)
        for i in range(bwd[0][1], len(rec.segment_ops)):
            self._emit(i, -1, -1)
        self.total = len(self.ops)

    def _emit(self, i: int, old: int, new: int) -> None:
        rec = self.blocks.rec
        self.ops.append(rec.segment_ops[i])
        self.mods.append(_rename(rec.segment_module[i], self.blocks.prefix, old, new))

    def moved(self, slot: int, new_block: Optional[int]) -> int:
        """Where traced ``slot`` lands, for a tensor of scaled block ``new_block`` (None: outside
        every block)."""
        blocks = self.blocks
        if slot >= blocks.slots:
            return self.total
        b, off = blocks.where(slot)
        if b is None:                     # outside blocks: shifted by what the blocks grew
            if slot < blocks.fwd[0][0]:
                return slot
            return slot + (self.n_forward - blocks.nf if slot < blocks.bwd[-1][0]
                           else self.total - blocks.slots)
        target = (new_block if 0 < b < blocks.n - 1
                  else (0 if b == 0 else len(self.order) - 1))
        return (self.new_fwd if slot < blocks.nf else self.new_bwd)[target] + off

    def tensors(self) -> list:
        """The saved tensors of the scaled step, in save order, renamed and moved."""
        blocks, moved = self.blocks, self.moved
        rec, fwd = blocks.rec, blocks.fwd
        before = [(t, None, None) for t in rec.tensors if t.saved_at < fwd[0][0]]
        inside = [(t, old, new) for new, old in enumerate(self.order) for t in rec.tensors
                  if fwd[old][0] <= t.saved_at < fwd[old][1]]
        after = [(t, None, None) for t in rec.tensors if t.saved_at >= fwd[-1][1]]
        tensors = [_moved_tensor(t, moved(t.saved_at, new), moved(t.first_used_at, new),
                                 blocks.prefix, old, new) for t, old, new in before + inside + after]
        for j, t in enumerate(tensors):
            t.order = j
        return tensors


def _moved_tensor(t: SavedTensor, saved_at: int, used: int, prefix: str, old, new) -> SavedTensor:
    rename = (lambda m: m) if old is None else (lambda m: _rename(m, prefix, old, new))
    return SavedTensor(t.nbytes, t.dtype, t.shape, rename(t.module), t.order, saved_at, used,
                       tuple(rename(m) for m in t.input_of))

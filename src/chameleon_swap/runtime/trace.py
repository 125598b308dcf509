"""The trace format: what the simulator knows about a training step, as versioned JSON.

One trace holds one or more steps. A step is the timeline of ``timeline.py``: compute *segments*
(seconds per slot, ``n_forward`` forward slots then backward slots) and the saved *tensors* (bytes,
the forward slot at whose end each is saved, the slot at whose start backward first needs it;
``first_used_at == len(segments)`` means never), plus the bytes of model state (parameters,
gradients, optimizer states) the device holds besides. Traces come from the profiler on a real
run (``Chameleon(trace_dir=...)``, ``chameleon-swap trace --workload``) or from the analytic
generator (``sim.analytic``), which also fills the optional fields recomputation needs: the block
(layer) of each tensor and forward segment, and a ``kind`` (``block_input`` survives full
recomputation, ``attn_core`` is what selective recomputation drops and redoes).

Recorded steps with ``model=`` (and traced ``--hf`` steps) carry the block structure as measured
instead: ``blocks``, one object per block call with the range of tensors saved inside it
(``first``, ``end``; in a recorded step tensor ``i`` is saved at the end of forward segment
``i``), its forward seconds, its input bytes and, where the block ran selective,
the bytes selective checkpointing kept and its recompute seconds; ``segment_block`` then names the
call of each forward segment. ``segment_waits`` holds the seconds per slot spent waiting for
copies, ``segment_moves`` the host seconds per slot spent moving tensors (on a CPU recording,
taken out of ``segments`` as the waits are; see the profiler), each the same length as
``segments`` when recorded and empty when not. All are optional: traces written before them load
unchanged (same format version).

Stdlib only, like the timeline: loading a trace never needs torch.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from ..planning.timeline import Profile, Span

FORMAT = "chameleon-swap-trace"
VERSION = 1
SOURCES = ("profiler", "analytic", "traced")
# One recorded block call: its tensors/forward segments [first, end), then forward seconds (None
# when not timed), input bytes, and selective's kept bytes and recompute seconds (None: not run).
BLOCK_KEYS = ("block", "first", "end", "input_bytes", "forward_seconds", "selective_bytes",
              "selective_seconds")


@dataclass(frozen=True)
class Tensor:
    nbytes: int
    saved_at: int
    first_used_at: int
    movable: bool = True
    block: Optional[int] = None        # layer it belongs to (recomputation), None outside blocks
    kind: str = ""                     # "block_input", "attn_core", or "" for any other


@dataclass
class Step:
    segments: list                     # seconds per slot
    n_forward: int
    tensors: list                      # of Tensor, in save order
    model_state_bytes: int = 0
    workspace_bytes: int = 0           # transient device memory besides saved activations
    tokens: int = 0
    tag: str = ""
    segment_block: Optional[list] = None   # per forward segment: its block, or None
    segment_kind: Optional[list] = None    # per forward segment: "attn_core" or ""
    measured: dict = field(default_factory=dict)   # a recorded step's own StepStats figures
    blocks: Optional[list] = None          # recorded block calls (dicts, see BLOCK_KEYS)
    segment_waits: list = field(default_factory=list)   # seconds waited per slot (recorded)
    segment_moves: list = field(default_factory=list)   # host seconds moving, per slot

    def __post_init__(self) -> None:
        self.validate("step")

    @property
    def n_slots(self) -> int:
        return len(self.segments)

    @property
    def compute_seconds(self) -> float:
        return float(sum(self.segments))

    @property
    def activation_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def has_blocks(self) -> bool:
        return self.segment_block is not None and any(b is not None for b in self.segment_block)

    def profile(self, d2h_bytes_per_s: float, h2d_bytes_per_s: float,
                segments: Optional[list] = None, keep: Optional[Iterable[int]] = None) -> Profile:
        """The timeline ``Profile`` of this step (optionally other segment times, or only the
        tensors in ``keep``, in their order)."""
        tensors = self.tensors if keep is None else [self.tensors[j] for j in keep]
        spans = tuple(Span(t.nbytes, t.saved_at, t.first_used_at, t.movable) for t in tensors)
        return Profile(compute=tuple(self.segments if segments is None else segments),
                       n_forward=self.n_forward, spans=spans,
                       d2h_bytes_per_s=d2h_bytes_per_s, h2d_bytes_per_s=h2d_bytes_per_s)

    def validate(self, where: str) -> None:
        segs = self.segments
        if not isinstance(segs, (list, tuple)) or not segs:
            raise ValueError(f"{where}.segments must be a non-empty list of seconds; got {segs!r}")
        for i, s in enumerate(segs):
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
                raise ValueError(f"{where}.segments[{i}] must be a finite number of seconds >= 0; "
                                 f"got {s!r}")
        n_slots, n_f = len(segs), self.n_forward
        if isinstance(n_f, bool) or not isinstance(n_f, int) or not 0 <= n_f <= n_slots:
            raise ValueError(f"{where}.n_forward must be an int in [0, {n_slots}] (the number of "
                             f"forward segments); got {n_f!r}")
        for j, t in enumerate(self.tensors):
            w = f"{where}.tensors[{j}]"
            if not isinstance(t, Tensor):
                raise ValueError(f"{w} must be a Tensor; got {type(t).__name__}")
            if not _int(t.nbytes) or t.nbytes < 0:
                raise ValueError(f"{w}.bytes must be an int >= 0; got {t.nbytes!r}")
            if not _int(t.saved_at) or not 0 <= t.saved_at < n_f:
                raise ValueError(f"{w}.saved_at must be a forward segment in [0, {n_f - 1}]; "
                                 f"got {t.saved_at!r}")
            if not _int(t.first_used_at) or not n_f <= t.first_used_at <= n_slots:
                raise ValueError(f"{w}.first_used_at must be a backward segment in [{n_f}, "
                                 f"{n_slots}] ({n_slots}: never used); got {t.first_used_at!r}")
            if t.block is not None and not _int(t.block):
                raise ValueError(f"{w}.block must be an int or null; got {t.block!r}")
        for name in ("model_state_bytes", "workspace_bytes", "tokens"):
            v = getattr(self, name)
            if not _int(v) or v < 0:
                raise ValueError(f"{where}.{name} must be an int >= 0; got {v!r}")
        for name in ("segment_block", "segment_kind"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (list, tuple)) or len(v) != n_f):
                raise ValueError(f"{where}.{name} must be null or a list with one entry per "
                                 f"forward segment ({n_f}); got {_short(v)}")
        for name in ("segment_waits", "segment_moves"):
            w = getattr(self, name)
            if not isinstance(w, (list, tuple)) or (w and len(w) != n_slots) or any(
                    isinstance(x, bool) or not isinstance(x, (int, float))
                    or not math.isfinite(x) or x < 0 for x in w):
                raise ValueError(f"{where}.{name} must be empty or a list of seconds >= 0, one "
                                 f"per segment ({n_slots}); got {_short(w)}")
        if self.blocks is not None:
            if not isinstance(self.blocks, (list, tuple)):
                raise ValueError(f"{where}.blocks must be null or a list; got {_short(self.blocks)}")
            for k, b in enumerate(self.blocks):
                wb = f"{where}.blocks[{k}]"
                if not isinstance(b, dict) or not set(BLOCK_KEYS[:4]) <= set(b):
                    raise ValueError(f"{wb} must be an object with {', '.join(BLOCK_KEYS[:4])}; "
                                     f"got {_short(b)}")
                n_t = len(self.tensors)
                if not (_int(b["first"]) and _int(b["end"]) and 0 <= b["first"] <= b["end"] <= n_t):
                    raise ValueError(f"{wb}: first/end must be ints with 0 <= first <= end <= "
                                     f"{n_t} (a range of tensors); got {b['first']!r}, "
                                     f"{b['end']!r}")
                if not _int(b["input_bytes"]) or b["input_bytes"] < 0:
                    raise ValueError(f"{wb}.input_bytes must be an int >= 0; "
                                     f"got {b['input_bytes']!r}")

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"n_forward": self.n_forward, "segments": list(self.segments),
                             "tensors": [_tensor_dict(t) for t in self.tensors],
                             "model_state_bytes": self.model_state_bytes}
        for name in ("workspace_bytes", "tokens", "tag", "segment_block", "segment_kind",
                     "measured", "blocks", "segment_waits", "segment_moves"):
            v = getattr(self, name)
            if v:
                d[name] = list(v) if isinstance(v, tuple) else v
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "Step":
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be an object; got {type(d).__name__}")
        for key in ("n_forward", "segments", "tensors"):
            if key not in d:
                raise ValueError(f"{where} lacks {key!r} (a step needs n_forward, segments, "
                                 f"tensors)")
        if not isinstance(d["tensors"], list):
            raise ValueError(f"{where}.tensors must be a list; got {_short(d['tensors'])}")
        tensors = []
        for j, t in enumerate(d["tensors"]):
            w = f"{where}.tensors[{j}]"
            if not isinstance(t, dict) or not {"bytes", "saved_at", "first_used_at"} <= set(t):
                raise ValueError(f"{w} must be an object with bytes, saved_at, first_used_at; "
                                 f"got {_short(t)}")
            tensors.append(Tensor(t["bytes"], t["saved_at"], t["first_used_at"],
                                  bool(t.get("movable", True)), t.get("block"),
                                  str(t.get("kind", ""))))
        step = cls.__new__(cls)
        step.segments = d["segments"]
        step.n_forward = d["n_forward"]
        step.tensors = tensors
        step.model_state_bytes = d.get("model_state_bytes", 0)
        step.workspace_bytes = d.get("workspace_bytes", 0)
        step.tokens = d.get("tokens", 0)
        step.tag = str(d.get("tag", ""))
        step.segment_block = d.get("segment_block")
        step.segment_kind = d.get("segment_kind")
        step.measured = dict(d.get("measured") or {})
        step.blocks = d.get("blocks")
        step.segment_waits = d.get("segment_waits") or []
        step.segment_moves = d.get("segment_moves") or []
        step.validate(where)
        return step


@dataclass
class Trace:
    steps: list
    source: str = "analytic"
    meta: dict = field(default_factory=dict)
    d2h_bytes_per_s: Optional[float] = None   # the link the steps ran with, when known
    h2d_bytes_per_s: Optional[float] = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"trace source must be one of {', '.join(SOURCES)}; got {self.source!r}")
        if not self.steps:
            raise ValueError("a trace needs at least one step")
        for name in ("d2h_bytes_per_s", "h2d_bytes_per_s"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"trace link.{name} must be a positive number or null; got {v!r}")

    @property
    def link(self) -> Optional[tuple]:
        if self.d2h_bytes_per_s and self.h2d_bytes_per_s:
            return self.d2h_bytes_per_s, self.h2d_bytes_per_s
        return None

    def to_dict(self) -> dict:
        link = None
        if self.link:
            link = {"d2h_bytes_per_s": self.d2h_bytes_per_s, "h2d_bytes_per_s": self.h2d_bytes_per_s}
        return {"format": FORMAT, "version": VERSION, "source": self.source, "meta": self.meta,
                "link": link, "steps": [s.to_dict() for s in self.steps]}

    @classmethod
    def from_dict(cls, d: Any, origin: str = "trace") -> "Trace":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"{origin} is not a chameleon-swap trace (expected a JSON object "
                             f"with \"format\": \"{FORMAT}\")")
        v = d.get("version")
        if v != VERSION:
            raise ValueError(f"{origin}: trace version {v!r} is not supported; this version of "
                             f"chameleon-swap reads version {VERSION}")
        steps = d.get("steps")
        if not isinstance(steps, list) or not steps:
            raise ValueError(f"{origin}: steps must be a non-empty list")
        link = d.get("link") or {}
        if not isinstance(link, dict):
            raise ValueError(f"{origin}: link must be an object or null; got {_short(link)}")
        meta = d.get("meta") or {}
        if not isinstance(meta, dict):
            raise ValueError(f"{origin}: meta must be an object; got {_short(meta)}")
        return cls(steps=[Step.from_dict(s, f"{origin}: steps[{i}]") for i, s in enumerate(steps)],
                   source=d.get("source", "analytic"), meta=meta,
                   d2h_bytes_per_s=link.get("d2h_bytes_per_s"),
                   h2d_bytes_per_s=link.get("h2d_bytes_per_s"))


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _tensor_dict(t: Tensor) -> dict:
    d: dict[str, Any] = {"bytes": t.nbytes, "saved_at": t.saved_at, "first_used_at": t.first_used_at}
    if not t.movable:
        d["movable"] = False
    if t.block is not None:
        d["block"] = t.block
    if t.kind:
        d["kind"] = t.kind
    return d


# ------------------------------------------------------------------------------------ files
def dumps(trace: Trace) -> str:
    return json.dumps(trace.to_dict(), separators=(",", ":"))


def loads(text: str, origin: str = "trace") -> Trace:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{origin} is not valid JSON ({exc})") from exc
    return Trace.from_dict(data, origin)


def save(trace: Trace, path: Union[str, Path]) -> Path:
    """Write ``trace`` to ``path`` atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(dumps(trace))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load(path: Union[str, Path]) -> Trace:
    """A trace file, or a directory of them (``trace_dir``): their steps in file-name order."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.json"))
        if not files:
            raise ValueError(f"trace directory {str(p)!r} holds no *.json trace files")
        parts = [loads(f.read_text(), str(f)) for f in files]
        first = parts[0]
        link = next((t for t in parts if t.link), first)
        return Trace(steps=[s for t in parts for s in t.steps], source=first.source,
                     meta=first.meta, d2h_bytes_per_s=link.d2h_bytes_per_s,
                     h2d_bytes_per_s=link.h2d_bytes_per_s)
    if not p.is_file():
        raise ValueError(f"trace: no such file or directory {str(p)!r}")
    return loads(p.read_text(), str(p))


# ------------------------------------------------------------------------------------ recording
def from_step_profile(profile, *, measured: Optional[dict] = None, meta: Optional[dict] = None,
                      link: Optional[tuple] = None, model_state_bytes: int = 0) -> Trace:
    """A one-step trace from the profiler's ``StepProfile`` (read by attribute, so this module
    needs no torch): its slot times, the bytes and first-use slot of every saved tensor."""
    n_f = profile.n_forward
    tensors = [Tensor(int(b), i, int(u)) for i, (b, u) in
               enumerate(zip(profile.nbytes, profile.use_slot))]
    segments = [float(c) for c in profile.compute]
    waits = [float(w) for w in (getattr(profile, "waits", None) or [])]
    moves = [float(m) for m in (getattr(profile, "moves", None) or [])]
    if n_f == 0:
        # A step that saved nothing (evaluation under no_grad): one segment, no tensors.
        segments = [float(sum(segments)) or float(profile.step_seconds)]
        waits = [float(sum(waits))] if waits else []
        moves = [float(sum(moves))] if moves else []
    if len(waits) != len(segments):
        waits = []
    if len(moves) != len(segments) or not any(moves):
        moves = []
    blocks, segment_block = _recorded_blocks(getattr(profile, "blocks", None) or [], n_f,
                                             segments)
    if blocks:
        tensors = [Tensor(t.nbytes, t.saved_at, t.first_used_at, t.movable,
                          segment_block[t.saved_at]) for t in tensors]
    step = Step(segments=segments, n_forward=n_f, tensors=tensors,
                model_state_bytes=int(model_state_bytes),
                tag=str(getattr(profile, "signature", ""))[:16], measured=dict(measured or {}),
                segment_block=segment_block if blocks else None, blocks=blocks or None,
                segment_waits=waits, segment_moves=moves)
    d2h, h2d = link if link else (None, None)
    return Trace(steps=[step], source="profiler", meta=dict(meta or {}),
                 d2h_bytes_per_s=d2h, h2d_bytes_per_s=h2d)


def _recorded_blocks(calls, n_f: int, segments: list) -> tuple[list, list]:
    """The block calls of a step (the recompute runner's ``BlockCall``s, read by attribute) as
    trace ``blocks``, and each forward segment's call number (None outside any call). Calls that
    saved nothing through the engine, or nested in another, are left out."""
    out: list = []
    segment_block: list = [None] * n_f
    for c in calls:
        lo, hi = int(c.first_record), int(c.end_record)
        if not 0 <= lo < hi <= n_f or any(b is not None for b in segment_block[lo:hi]):
            continue
        fwd = getattr(c, "forward_seconds", None)
        rec = getattr(c, "recompute_seconds", None)
        sel = getattr(c, "mode", "") == "selective"
        k = len(out)
        out.append({"block": int(c.block), "first": lo, "end": hi,
                    "input_bytes": int(c.input_bytes),
                    "forward_seconds": float(fwd) if fwd is not None else float(
                        sum(segments[lo:hi])),
                    "selective_bytes": int(c.selective_bytes) if sel else None,
                    "selective_seconds": float(rec) if sel and rec is not None else None})
        segment_block[lo:hi] = [k] * (hi - lo)
    return out, segment_block


def write_step(trace_dir: Union[str, Path], index: int, profile, **kwargs) -> Path:
    """Write one recorded step as ``<trace_dir>/step-<index>.json`` (``load(trace_dir)`` reads
    them all back in order)."""
    return save(from_step_profile(profile, **kwargs), Path(trace_dir) / f"step-{index:06d}.json")

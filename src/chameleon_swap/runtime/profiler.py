"""The online profiler: on in every step, cheap; detailed (timed) only when a plan must be made.

Lightweight mode (every step) turns module calls and saved tensors into event ids
(``sequence.EventVocab``), gives every new saved storage a ``TensorKey`` and records the order in
which backward first needs each one. That is enough for the step's exact signature, its similarity
to earlier steps, fuzzy matching, and a plan from estimated slot times: a sequence timed before
(same signature) gets that step's shares of compute per slot, scaled to this step's measured
compute; one never timed gets shares in proportion to the bytes its slots save and first use.
The shares matter: a recomputed block saves only its inputs, so by bytes its recompute and
backward look nearly free while a kept block's backward looks long, and a plan made from that
shape hides copies behind compute that is not there (measured on a 4-block HF Llama at 25%: a
plan from such a step predicted 1 ms of stall for steps that waited 48 ms).

Detailed mode adds a timestamp at every save and every first use: ``time.perf_counter`` on the
CPU, CUDA events on the compute stream otherwise (read at step end, after the engine's end-of-step
synchronization, which a timed step always has, so nothing inside the step waits for the device).

A *slot* is the compute between two timestamps (see ``timeline``): forward slot ``i`` ends with the
save of record ``i``; slot ``n_forward`` runs from the last save to the first use in backward; then
one slot per first use; the last slot runs to the end of the step.

Compute apart from waiting: time the step spent waiting for copies (budget waits, fetches on
demand, the compute stream waiting on a copy event) is measured where it happens, by the copy
engine, with the slot it fell in (``current_slot``). ``finish`` keeps it per slot in ``waits``
and takes it out of that slot's ``compute``: a step that stalled gives the planner the same
compute as one that did not, and the stall is the model's to predict, not an input.

Moves apart from compute, likewise: the host time the executor spends moving a tensor (taking
its byte view and host buffer, issuing its copies, handling their completion, rebuilding it on
its way back) is timed where it happens (``on_move``) and kept per slot in ``moves``. Where slots
are timed on the host's clock (the CPU), it is taken out of ``compute`` too: the keep view a plan
is made from then holds the blocks' own compute, and what moving costs is the timeline's
``move_seconds``, charged to the mixes that move (``move_seconds_each`` is this step's measure of
it). On CUDA the slots are timed by the device, which the host's work overlaps: ``moves`` is
reported, not taken out.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..planning.signatures import EventVocab, TensorKey, signature, size_class


@dataclass
class StepProfile:
    """What the profiler learnt from one step (input of the planner)."""

    ids: list[int]                     # event ids, in order (module calls and saves)
    signature: str
    keys: list[TensorKey]              # per record (span), in save order
    nbytes: list[int]
    use_slot: list[int]                # per record: slot at whose start backward first needs it
    compute: list[float]               # seconds per slot (measured when detailed, else estimated)
    n_forward: int
    detailed: bool
    step_seconds: float = 0.0
    profiler_seconds: float = 0.0      # host time spent in the profiler during the step
    extra: dict = field(default_factory=dict)
    reserve: list[int] = field(default_factory=list)   # per slot: most bytes held outside the
                                                       # records (empty: none held)
    blocks: list = field(default_factory=list)         # the recompute runner's block calls
    waits: list = field(default_factory=list)          # per slot: seconds spent waiting for
                                                       # copies (not in ``compute``)
    moves: list = field(default_factory=list)          # per slot: host seconds spent moving
                                                       # tensors (not in ``compute`` on the CPU)
    moved: int = 0                                     # tensors moved out (copies issued)
    moves_apart: bool = False                          # ``moves`` taken out of ``compute``

    @property
    def move_seconds_each(self) -> Optional[float]:
        """Host seconds one moved tensor cost the step (its copy out and back, the books), as
        timed, with the copy threads' own CPU time (``extra["copy_cpu"]``, see ``copy/cpu.py``:
        the compute thread's timed part alone read a move at about half what it cost the step);
        None when nothing moved or the moves are not apart from compute (CUDA)."""
        if not self.moved or not self.moves_apart:
            return None
        return (float(sum(self.moves)) + float(self.extra.get("copy_cpu", 0.0))) / self.moved

    @property
    def n_slots(self) -> int:
        return len(self.compute)

    def to_timeline(self, d2h_bytes_per_s: float, h2d_bytes_per_s: float):
        from ..planning.timeline import Profile, Span
        spans = tuple(Span(nbytes=b, save=i, use=u) for i, (b, u) in
                      enumerate(zip(self.nbytes, self.use_slot)))
        return Profile(compute=tuple(self.compute), n_forward=self.n_forward, spans=spans,
                       d2h_bytes_per_s=d2h_bytes_per_s, h2d_bytes_per_s=h2d_bytes_per_s,
                       reserve=tuple(self.reserve))


_DTYPE_NAMES: dict = {}
_new_key = TensorKey._make      # from one tuple: half the cost of TensorKey(...) per save
_SIZE_CLASSES: dict = {}        # nbytes -> size_class(nbytes): a dict lookup per save, not a call
_SIZE_CLASSES_MAX = 4096        # bounded: byte counts vary with every sequence length
SHAPES_KEPT = 64                # timed sequences whose compute shares a light step can reuse


class _CpuClock:
    host = True                  # slots timed on the host's clock: host work is in them

    def mark(self):
        return time.perf_counter()

    def now(self) -> float:
        """Host seconds on the clock the slots are timed on (moves are timed on it)."""
        return self.mark()

    def seconds(self, marks: list) -> list[float]:
        return list(marks)


class _CudaClock:
    host = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def now(self) -> float:
        return time.perf_counter()

    def mark(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def seconds(self, marks: list) -> list[float]:
        # A timed step ends with a synchronization, but the end mark is recorded after it, and a
        # mark may sit on another stream than the last one: wait for each (all but the end mark
        # have completed already, so this is a query each) before reading times.
        if not marks:
            return []
        for m in marks:
            m.synchronize()
        first = marks[0]
        return [first.elapsed_time(m) / 1e3 for m in marks]


class Profiler:
    def __init__(self, device: torch.device) -> None:
        self.vocab = EventVocab()
        # Module -> uid, keyed by a plain weak reference (a WeakKeyDictionary's get is Python
        # code on every module call). A dead module's entry can never match again (dead
        # references compare by identity); uids come from a counter, so none is reused.
        self._uids: dict = {}
        self._next_uid = 0
        self._clock = _CudaClock(device) if device.type == "cuda" else _CpuClock()
        # ``now()``: host seconds to time a move with; on the CPU, the clock the slots are timed
        # on. The clock's own method, bound here: a move is timed three or four times.
        self.now: Callable[[], float] = self._clock.now
        self.detailed = False
        self.last_profile: Optional[StepProfile] = None
        # saves_only: the engine never moves anything and sends no module events; its hooks
        # (resident.py) append one raw tuple per save to ``raw`` (dtype, storage bytes, and the
        # shape when the save starts a record), turned into ids and keys at ``finish``: the
        # same ids ``on_save`` gives with no module running.
        self.saves_only = False
        self._prev_raw: Optional[list] = None
        self._prev_out: tuple = ()
        self._shapes: dict[str, tuple] = {}    # signature -> compute shares per slot, as timed
        self._waits_seen = 0                   # ``wait_slot`` calls since the last ``finish``
        self._reset()

    def _reset(self) -> None:
        self.ids: list[int] = []
        self.keys: list[TensorKey] = []
        self.nbytes: list[int] = []
        self.used: list[int] = []              # record indices in order of first use
        self._stack: list[list] = []           # [uid, call, saves so far] per running module
        self._calls: dict[int, int] = {}
        self._marks: list = []                 # detailed: start, each save, each first use, end
        self._use_marks: list = []
        self._held: list[tuple[int, int]] = []  # (slot, bytes held from then on) per change
        self._seconds = 0.0
        self._t0 = 0.0
        self.raw: list = []
        self._moves: list[tuple[int, float]] = []   # (slot, host seconds) per timed move
        self._move_seconds = 0.0                    # their sum so far
        self._moved = 0

    # ------------------------------------------------------------------ step boundaries
    def begin_step(self, detailed: bool) -> None:
        self._reset()
        self.detailed = detailed
        self._t0 = time.perf_counter()
        if detailed:
            self._marks.append(self._clock.mark())

    def current_slot(self) -> int:
        """The slot the step is in now (as ``finish`` will count slots)."""
        return len(self.nbytes) + len(self.used)

    def wait_slot(self) -> int:
        """The copy engine's ``stall_slot``: called once per wait, as the wait is counted (the
        ``k``-th call since the last ``finish`` is the ``k``-th of the stalls given to it)."""
        self._waits_seen += 1
        return self.current_slot()

    def apart_mark(self) -> tuple[int, float]:
        """Where the step's time apart from compute stands now: (waits counted so far, host
        seconds of moves so far where ``finish`` takes moves out of compute, else 0.0). The
        recompute runner reads it around each recompute, whose time it then takes the waits and
        moves between the two out of (``BlockRunner.end_step``), as ``finish`` does for slots:
        a recompute that waited for its block's input to come back is not slower compute."""
        return self._waits_seen, (self._move_seconds if self._clock.host else 0.0)

    def finish(self, step_seconds: float, stalls=()) -> StepProfile:
        """The step's profile. ``stalls``: its waits for copies, (slot, seconds) each (the copy
        engine's ``take_stalls()``); they are kept apart from the compute of their slots."""
        t = time.perf_counter()
        if self.saves_only:
            self._from_raw()
        n = len(self.nbytes)
        rank = {rec: r for r, rec in enumerate(self.used)}
        n_used = len(self.used)
        n_slots = n + 1 + n_used
        use_slot = [n + 1 + rank[i] if i in rank else n_slots for i in range(n)]
        waits = _per_slot_sum(stalls, n_slots)
        self._waits_seen = 0                   # (the stalls given are those counted)
        moves = _per_slot_sum(self._moves, n_slots)
        apart = self._clock.host
        # On the host's clock a slot's time holds the host's moves: taken out like the waits.
        off = [w + m for w, m in zip(waits, moves)] if apart else waits
        sig = signature(self.ids)
        if self.detailed and n:
            self._marks.append(self._clock.mark())   # end of the step
            times = self._clock.seconds(self._marks[:1 + n] + self._use_marks + self._marks[-1:])
            compute = [max(0.0, b - a - w) for a, b, w in zip(times, times[1:], off)]
            self._remember_shape(sig, compute)
        else:
            compute = self._estimate(n, max(0.0, step_seconds - sum(off)), self._shapes.get(sig))
        self._seconds += time.perf_counter() - t
        self.last_profile = StepProfile(ids=self.ids, signature=sig, keys=self.keys,
                           nbytes=self.nbytes, use_slot=use_slot, compute=compute, n_forward=n,
                           detailed=self.detailed and n > 0, step_seconds=step_seconds,
                           profiler_seconds=self._seconds,
                           reserve=_per_slot(self._held, len(compute)),
                           waits=waits, moves=moves, moved=self._moved, moves_apart=apart)
        return self.last_profile

    def _from_raw(self) -> None:
        """``ids``, ``keys`` and ``nbytes`` from ``raw`` (saves_only). A step whose saves are
        those of the previous step, the common case, reuses its lists (one list comparison)."""
        raw = self.raw
        if raw == self._prev_raw:
            self.ids, self.keys, self.nbytes = self._prev_out
            return
        ids, keys, nbytes = [], [], []
        vid = self.vocab.id
        for ordinal, ev in enumerate(raw):
            dt, nb = ev[0], ev[1]
            dtype = _DTYPE_NAMES.get(dt) or _DTYPE_NAMES.setdefault(dt, str(dt))
            cls = _SIZE_CLASSES.get(nb)
            if cls is None:
                cls = _size_class(nb)
            new = len(ev) == 3
            ids.append(vid(("s", -1, 0, ordinal, dtype, cls, new)))
            if new:
                keys.append(_new_key((-1, 0, ordinal, dtype, tuple(ev[2]))))
                nbytes.append(nb)
        self._prev_raw, self._prev_out = raw, (ids, keys, nbytes)
        self.ids, self.keys, self.nbytes = ids, keys, nbytes

    def _remember_shape(self, sig: str, compute: list) -> None:
        total = sum(compute)
        if total <= 0:
            return
        self._shapes.pop(sig, None)              # most recent last (least recent goes first)
        self._shapes[sig] = tuple(c / total for c in compute)
        if len(self._shapes) > SHAPES_KEPT:
            del self._shapes[next(iter(self._shapes))]

    def _estimate(self, n: int, step_seconds: float, shape: Optional[tuple] = None) -> list[float]:
        """Slot times from limited information, scaled to the step's measured compute: the
        shares of a timed step of the same sequence (``shape``), else work proportional to the
        bytes a slot saves in forward and twice that for the backward slot that first uses them."""
        if n == 0:
            return [step_seconds]
        if shape is not None and len(shape) == n + 1 + len(self.used):
            return [step_seconds * w for w in shape]
        fwd = [float(b) for b in self.nbytes]
        back = [2.0 * self.nbytes[i] for i in self.used]
        weights = fwd + [0.0] + back + [0.0]
        weights = weights[:n + 1 + len(self.used)]
        total = sum(weights) or 1.0
        return [step_seconds * w / total for w in weights]

    # ------------------------------------------------------------------ events
    def module_enter(self, module: torch.nn.Module) -> None:
        t = time.perf_counter()
        key = weakref.ref(module)
        uid = self._uids.get(key)
        if uid is None:
            uid = self._uids[key] = self._next_uid
            self._next_uid += 1
        call = self._calls.get(uid, 0)
        self._stack.append([uid, call, 0])
        if torch.is_grad_enabled():       # calls under no_grad save nothing: not in the sequence
            self._calls[uid] = call + 1
            self.ids.append(self.vocab.id(("m", uid, call)))
        self._seconds += time.perf_counter() - t

    def module_exit(self, module: torch.nn.Module) -> None:
        if self._stack:
            self._stack.pop()

    def on_save(self, t: torch.Tensor, new_record: bool,
                nbytes: Optional[int] = None) -> Optional[TensorKey]:
        """A tensor was packed (``nbytes``: its storage's, when the caller has it). Returns the
        key when it started a new record (span)."""
        t0 = time.perf_counter()
        if self._stack:
            frame = self._stack[-1]
            uid, call, ordinal = frame
            frame[2] += 1
        else:
            uid, call, ordinal = -1, 0, len(self.ids)
        dt = t.dtype
        dtype = _DTYPE_NAMES.get(dt) or _DTYPE_NAMES.setdefault(dt, str(dt))
        if nbytes is None:
            nbytes = t.untyped_storage().nbytes()
        cls = _SIZE_CLASSES.get(nbytes)
        if cls is None:
            cls = _size_class(nbytes)
        self.ids.append(self.vocab.id(("s", uid, call, ordinal, dtype, cls, new_record)))
        key = None
        if new_record:
            key = _new_key((uid, call, ordinal, dtype, tuple(t.shape)))
            self.keys.append(key)
            self.nbytes.append(nbytes)
            if self.detailed:
                self._marks.append(self._clock.mark())
        self._seconds += time.perf_counter() - t0
        return key

    def on_first_use(self, index: int) -> None:
        """Backward needs record ``index`` for the first time this step."""
        t0 = time.perf_counter()
        self.used.append(index)
        if self.detailed:
            self._use_marks.append(self._clock.mark())
        self._seconds += time.perf_counter() - t0

    def on_move(self, seconds: float, new: bool = False) -> None:
        """The executor spent ``seconds`` of host time moving a tensor (``new``: it issued the
        tensor's copy out, so one more tensor moved this step)."""
        self._moves.append((len(self.nbytes) + len(self.used), seconds))
        self._move_seconds += seconds
        self._moved += new

    def on_hold(self, held_bytes: int) -> None:
        """Bytes held outside the records (selective checkpointing's, a recompute's) changed to
        ``held_bytes``. Slots are counted as in ``finish``: saves so far plus first uses so far."""
        self._held.append((len(self.nbytes) + len(self.used), held_bytes))

    @property
    def seconds(self) -> float:
        return self._seconds

    @property
    def clock(self):
        """``mark()`` / ``seconds(marks)`` on this device (CUDA events read after the step)."""
        return self._clock


def _size_class(nbytes: int) -> int:
    cls = size_class(nbytes)
    if len(_SIZE_CLASSES) < _SIZE_CLASSES_MAX:
        _SIZE_CLASSES[nbytes] = cls
    return cls


def _per_slot_sum(entries, n_slots: int) -> list[float]:
    """Seconds per slot from ``(slot, seconds)`` entries (slots clamped into the step)."""
    out = [0.0] * n_slots
    for slot, sec in entries:
        out[min(max(slot, 0), n_slots - 1)] += sec
    return out


def _per_slot(changes: list[tuple[int, int]], n_slots: int) -> list[int]:
    """Most bytes held during each slot, from the changes in order (empty if nothing was)."""
    if not any(b for _, b in changes):
        return []
    out = [0] * n_slots
    held, i = 0, 0
    for s in range(n_slots):
        top = held
        while i < len(changes) and changes[i][0] <= s:
            held = changes[i][1]
            top = max(top, held)
            i += 1
        out[s] = top
    return out

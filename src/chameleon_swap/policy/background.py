"""A planner process beside the training process: mode plans made while steps run.

``Worker`` starts, at its first job, one Python process that runs ``planning/jobs.py``'s
``serve``: jobs go down its standard input and results come back on its standard output, both
pickled, and two daemon threads here write and read them as the process takes and gives them.
The step's thread only hands a job over (a pickle of the plan's inputs: about 0.2 ms on the CPU
demo) and, at a later step, picks the result up where it is there (``ready``); it never waits
for one unless asked (``result``).
Planning is pure Python, so a thread would hold the interpreter's lock against the step's own
Python work: a process runs it on another core, with nothing of the parent (the process is
started from scratch, not forked: the parent's copy threads and any CUDA context stay its own),
and without torch (``planning/`` imports none: the worker starts in about 50 ms).

A job's time is its CPU time (not the wall time a process waits for a core), which is what
the planning share charges. The process runs at its parent's priority: ten steps nicer, on this
project's 2-core CPU with torch's two threads busy, it was starved long enough that plans landed
after the short runs of the tests that check what they do (a 3-step test on a tiny model failed
2 of 2 in the policy suite): where no core is spare it competes with training, as planning on the
step's thread did (``plan_in_background=False`` keeps that).

The worker imports the package's ``planning/`` from the directory this package was loaded from
(a stand-in package object, so the package's own ``__init__``, and torch with it, is not run),
in isolated mode (``-I -S``: no user site, no environment's ``PYTHON*`` settings, only the
standard library besides).

A worker that cannot start, dies or answers with an error is not retried: ``broken`` says why,
and every job from then on is planned in-process by the caller, as without a worker. Closing
(``close``, or the worker's collection, or the interpreter's exit) ends its input: the process
exits at that, and is killed if it has not within ``CLOSE_WAIT_S``.
"""
from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from typing import Optional

CLOSE_WAIT_S = 0.5
BOOT = ("import sys, types\n"
        "pkg = types.ModuleType('chameleon_swap')\n"
        "pkg.__path__ = [sys.argv[1]]\n"
        "sys.modules['chameleon_swap'] = pkg\n"
        "out, sys.stdout = sys.stdout.buffer, sys.stderr   # a stray print cannot garble answers\n"
        "from chameleon_swap.planning.jobs import serve\n"
        "serve(sys.stdin.buffer, out)\n")


class _Shared:
    """What the reader thread and the worker's owner share (no reference to the owner, so that
    a worker nobody holds is collected and its process ended)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.done: dict[int, tuple] = {}        # ticket -> (seconds, ok, value)
        self.dropped: set[int] = set()          # tickets whose answers nobody will take
        self.broken: Optional[str] = None
        self.waiting = 0                        # jobs handed over, not answered yet
        self.busy_from = 0.0                    # ``time.perf_counter()`` when the last run of
                                                # jobs began (one waiting since then)
        self.busy = deque(maxlen=64)            # (from, to) of the runs of jobs since ended


def _read(stdout, shared: _Shared) -> None:
    why = "the planner process ended"
    try:
        while True:
            ticket, seconds, ok, value = pickle.load(stdout)
            with shared.cond:
                shared.waiting -= 1
                if shared.waiting == 0:
                    shared.busy.append((shared.busy_from, time.perf_counter()))
                if ticket in shared.dropped:
                    shared.dropped.discard(ticket)
                else:
                    shared.done[ticket] = (seconds, ok, value)
                shared.cond.notify_all()
    except EOFError:
        pass
    except Exception as e:          # (an answer that did not unpickle: the stream is lost)
        why = f"the planner process's answer could not be read ({type(e).__name__}: {e})"
    with shared.cond:
        shared.broken = shared.broken or why
        shared.cond.notify_all()


def _write(stdin, jobs: queue.Queue, shared: _Shared) -> None:
    """Write jobs (pickled already) as the process reads them: a large job fills the pipe while
    the process is busy with the one before (64 blocks: about 1 s), and the step's thread must
    not wait for that."""
    while (job := jobs.get()) is not None:
        try:
            stdin.write(job)
            stdin.flush()
        except (OSError, ValueError) as e:
            with shared.cond:
                shared.broken = shared.broken or f"a job could not reach the planner process ({e})"
                shared.cond.notify_all()
            break
    try:
        stdin.close()               # (the process exits at the end of its input)
    except OSError:
        pass


def _stop(proc: subprocess.Popen, jobs: queue.Queue, owner: int) -> None:
    if os.getpid() != owner:        # a fork of the owner (a data loader's worker): not its own
        return
    jobs.put(None)
    try:
        proc.wait(CLOSE_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Worker:
    def __init__(self) -> None:
        self._shared = _Shared()
        self._proc: Optional[subprocess.Popen] = None
        self._next = 0
        self._jobs: queue.Queue = queue.Queue()
        self._stop: Optional[weakref.finalize] = None

    @property
    def broken(self) -> Optional[str]:
        """Why jobs are no longer taken (None while they are)."""
        return self._shared.broken

    def submit(self, name: str, *args) -> Optional[int]:
        """Hand job ``name`` (``planning.jobs.JOBS``) over; returns its ticket, or None where no
        worker runs (``broken``): the caller then makes the plan itself."""
        if self.broken is not None or (self._proc is None and not self._start()):
            return None
        ticket, self._next = self._next, self._next + 1
        try:        # (pickled now: the inputs as they are at the call, whatever changes later)
            job = pickle.dumps((ticket, name, args), protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            self._fail(f"a job could not be handed to the planner process ({e})")
            return None
        s = self._shared
        with s.cond:
            if s.waiting == 0:
                s.busy_from = time.perf_counter()
            s.waiting += 1
        self._jobs.put(job)
        return ticket

    def busy_seconds(self, since: float) -> float:
        """How long the process has had jobs to work on since ``since`` (a
        ``time.perf_counter()`` reading): from a job's hand-over, or the answer before it
        where it waited behind one, to its answer (the wall time: jobs run one at a time, and
        a process that waits for a core is still one more thread asking for it)."""
        s = self._shared
        now = time.perf_counter()
        with s.cond:
            runs = list(s.busy) + ([(s.busy_from, now)] if s.waiting > 0 else [])
        return sum(max(0.0, min(to, now) - max(fro, since)) for fro, to in runs)

    def ready(self, ticket: int) -> bool:
        """Whether ``result(ticket)`` would return at once."""
        s = self._shared
        with s.cond:
            return ticket in s.done or s.broken is not None

    def result(self, ticket: int) -> tuple[float, bool, object]:
        """``(seconds, ok, value)`` of the job, waiting for it: ``seconds`` the job's own time,
        ``value`` its result, or why there is none (``ok`` False: the job failed, or the worker
        did before answering)."""
        s = self._shared
        with s.cond:
            while ticket not in s.done and s.broken is None:
                s.cond.wait()
            return s.done.pop(ticket, (0.0, False, s.broken))

    def drop(self, ticket: int) -> None:
        """Nobody will take ``ticket``'s answer (a newer job for the same plan went after it)."""
        s = self._shared
        with s.cond:
            if s.done.pop(ticket, None) is None:
                s.dropped.add(ticket)

    def close(self) -> None:
        self._fail("the planner process was closed")

    # ------------------------------------------------------------------ the process
    def _start(self) -> bool:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package's
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", BOOT, here],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        except (OSError, ValueError) as e:    # (no executable: an embedded interpreter)
            self._fail(f"the planner process could not start ({e})")
            return False
        self._proc = proc
        self._stop = weakref.finalize(self, _stop, proc, self._jobs, os.getpid())
        for target, args in ((_read, (proc.stdout, self._shared)),
                             (_write, (proc.stdin, self._jobs, self._shared))):
            threading.Thread(target=target, args=args, daemon=True,
                             name="chameleon-swap planner").start()
        return True

    def _fail(self, why: str) -> None:
        with self._shared.cond:
            self._shared.broken = self._shared.broken or why
            self._shared.cond.notify_all()
        if self._stop is not None:
            self._stop()

"""Graceful preemption: SIGTERM / SIGUSR1 (SLURM's warning signals) and Ctrl-C ask the job to stop after writing a
checkpoint (Ctrl-C as SIGTERM, then exit status 130; a second Ctrl-C stops at once, without one). Ranks may receive
the signal at different times, so every decision to stop is agreed with an all-reduce at a point all ranks pass.

SIGUSR1 comes with time to spare (`#SBATCH --signal=USR1@120`; `rlhf.cli.launch` relays either signal as
SIGUSR1 and waits its --grace_period): the current step ends, then the checkpoint. SIGTERM is usually followed
by SIGKILL within seconds (plain torchrun's --shutdown_timeout, 30 s by default; SLURM's KillWait): a step that
has not yet changed any trained weight is abandoned at its next abandon point (a long local loop, such as the
HF engine's decode, stops early inside `abandonable()`), the job rolls back what the step changed so far, and
the checkpoint is of the last completed step. A step past its first optimizer update still ends first.

Under torchrun a worker also stops when its launcher is gone: plain torchrun dies at once on a signal it does not
handle (SIGUSR1), and its workers, left running with nobody to stop them, would train on unsupervised until the
next collective timeout. They notice the new parent process, checkpoint at the end of the step and exit 0. Only
under torchrun: a job started from a shell that then exits (`nohup`) is meant to keep running."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

PARENT_POLL_S = 1.0
SECOND_PRESS_S = 1.0
INTERRUPTED_STATUS = 130  # a shell's status for a program ended by Ctrl-C (128 + SIGINT)


class StepAbandoned(Exception):
    """Raised on every rank at an abandon point once any rank got SIGTERM: the step's work is dropped."""


class CutShort(BaseException):
    """Raised inside `interruptible()` by SIGTERM or Ctrl-C: the blocking call it interrupts (a reward function, a
    reward server's answer) is not needed, since the step is dropped at the next abandon point. A BaseException,
    as KeyboardInterrupt: a reward function's own `except Exception` does not swallow it."""


class PreemptionWatch:
    """Installs the handlers on construction (and, under torchrun, a daemon thread watching the launcher) and
    becomes the process's active watch (`abandon_point`, `cut_short`); `should_stop()` is collective over the
    world."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, watch_parent: bool | None = None) -> None:
        global _ACTIVE
        self.requested = False  # stop after a checkpoint
        self.hurry = False  # SIGTERM or Ctrl-C: abandon the step at its next abandon point if it can be
        self.first: signal.Signals | None = None  # the first signal received
        self._interrupted_at: float | None = None  # the first Ctrl-C
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)
        if watch_parent if watch_parent is not None else "TORCHELASTIC_RUN_ID" in os.environ:
            self._parent, self._exiting = os.getppid(), threading.Event()
            self._thread = threading.Thread(target=self._watch_parent, name="rlhf-launcher-watch", daemon=True)
            self._thread.start()
            atexit.register(self._join)
        _ACTIVE = self

    def _join(self) -> None:
        """At interpreter exit: no thread of ours is left running while Python finalizes (see heartbeat.py)."""
        self._exiting.set()
        self._thread.join(timeout=5)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self._ctrl_c()
        self.first = self.first or signal.Signals(signum)
        self.requested = True
        self.hurry = self.hurry or signum in (signal.SIGTERM, signal.SIGINT)
        if self.hurry and _INTERRUPTIBLE and self is _ACTIVE:
            raise CutShort

    def _ctrl_c(self) -> None:
        """Ctrl-C reaches every rank (and the launcher: one press can arrive twice, the terminal's and the
        launcher's), so a second one counts after SECOND_PRESS_S: it ends the process at once, exit 130. Lines
        written with os.write: a print from a signal handler can re-enter a print the main thread was in."""
        now, rank = time.monotonic(), os.environ.get("RANK", "0")
        if self._interrupted_at is None:
            self._interrupted_at = now
            if rank == "0":
                os.write(2, b"\n[rank 0] Ctrl-C: ending this step (dropping it if it has not trained yet), then a "
                            b"checkpoint and exit; Ctrl-C again to stop at once, without a checkpoint\n")
        elif now - self._interrupted_at > SECOND_PRESS_S:
            os.write(2, f"\n[rank {rank}] Ctrl-C again: stopping now, without a checkpoint\n".encode())
            os._exit(INTERRUPTED_STATUS)

    @property
    def interrupted(self) -> bool:
        """Ctrl-C (SIGINT) asked for the stop: the process exits INTERRUPTED_STATUS, not 0, after the checkpoint
        (a script's next stage must not start on an interrupted run's model)."""
        return self.first == signal.SIGINT

    def cause(self) -> str:
        """How the stop was asked for, for the line that reports it."""
        if self.interrupted:
            return "interrupted (Ctrl-C)"
        return f"preempted ({self.first.name})" if self.first else "preempted (the launcher is gone)"

    def _watch_parent(self) -> None:
        while os.getppid() == self._parent:
            if self._exiting.wait(PARENT_POLL_S):
                return
        print(f"[rank {os.environ.get('RANK', '0')}] the launcher (pid {self._parent}) is gone: checkpointing at "
              "the end of this step, then exiting", file=sys.stderr, flush=True)
        self.requested = True

    def should_stop(self) -> bool:
        """True on every rank if any rank was signalled. Every rank calls it once per step."""
        return _any_rank(self.requested)


_ACTIVE: PreemptionWatch | None = None
_IN_WINDOW = False
_INTERRUPTIBLE = False  # inside `interruptible()`: the signal handler raises CutShort


def exit_status() -> int:
    """The status a job that returned ends with: INTERRUPTED_STATUS after a Ctrl-C, else 0."""
    return INTERRUPTED_STATUS if _ACTIVE is not None and _ACTIVE.interrupted else 0


def _any_rank(flag: bool) -> bool:
    value = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def abandon_point(rollback: Callable[[], None]) -> None:
    """Raises StepAbandoned on every rank if any rank got SIGTERM, after `rollback()` has undone what the step
    changed so far. Collective (the world): call it only where every rank passes, before the step changes any
    trained weight or optimizer state. Without an active watch (no run): nothing."""
    if _ACTIVE is not None and _any_rank(_ACTIVE.hurry):
        rollback()
        raise StepAbandoned


@contextmanager
def abandonable() -> Iterator[None]:
    """Work inside may be cut short on SIGTERM (`cut_short`); an abandon point must follow it, and its
    results must not be used when that point raises."""
    global _IN_WINDOW
    _IN_WINDOW = True
    try:
        yield
    finally:
        _IN_WINDOW = False


def cut_short() -> bool:
    """True inside `abandonable()` once this rank got SIGTERM: a long local loop may return early."""
    return _IN_WINDOW and _ACTIVE is not None and _ACTIVE.hurry


@contextmanager
def interruptible() -> Iterator[None]:
    """Inside `abandonable()`: a blocking call here (Python code, sleeps, socket waits; not C code that never
    returns to Python) is interrupted by SIGTERM or Ctrl-C with `CutShort`, raised at once if the signal came
    before. Elsewhere (an evaluation, no run) nothing: a result outside a step's window is always used. The
    caller catches `CutShort` and carries on with a stand-in result (the step will be dropped), so that every
    rank still makes the same collectives up to the abandon point."""
    global _INTERRUPTIBLE
    if not _IN_WINDOW or _ACTIVE is None:
        yield
        return
    if _ACTIVE.hurry:
        raise CutShort
    _INTERRUPTIBLE = True
    try:
        yield
    finally:
        _INTERRUPTIBLE = False


def hurry_agreed() -> bool:
    """Whether any rank got SIGTERM or Ctrl-C: for a loop of collective rounds inside a step (dynamic filtering's)
    to end together. Collective (the world)."""
    return _ACTIVE is not None and _any_rank(_ACTIVE.hurry)

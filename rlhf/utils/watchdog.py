"""Says where a rank is stuck: a process-wide record of the stage this rank last entered (updated by
`StageTimer.stage` and `stage()`), and a daemon thread that prints it to stderr after every
`interval_s` seconds without progress (no stage entered or left).

A rank that is stopped (SIGSTOP) or spinning inside C code that holds the GIL cannot print; its peers,
waiting in a collective, can, and their lines name the stage in which they wait. This module knows
nothing about collectives or configs; `--dist_timeout` (the collectives' own limit) is applied in
`rlhf.distributed.launch_env`.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TextIO


@dataclass
class _Progress:
    """Mutated by the training thread, read by the watchdog thread (each field is set atomically)."""

    stack: tuple[str, ...] = ()  # the stages entered and not yet left, outermost first
    last_left: str | None = None
    since_wall: float = 0.0  # time.time() of the last stage entry or exit
    count: int = 0  # progress events (stages entered or left) so far
    step: int | None = None
    patience: float = 0.0  # the current stage's announced length: no line before it has passed


_PROGRESS = _Progress(since_wall=time.time())


def enter(name: str) -> None:
    """Record that this rank entered stage `name` (nested inside the current one)."""
    _PROGRESS.stack = (*_PROGRESS.stack, name)
    _mark()


def leave() -> None:
    """Record that this rank left its innermost stage."""
    _PROGRESS.last_left = "/".join(_PROGRESS.stack)
    _PROGRESS.stack = _PROGRESS.stack[:-1]
    _mark()


def set_step(step: int) -> None:
    """The training step in progress, numbered as in the metrics (the first is 1), shown in the lines."""
    _PROGRESS.step = step


@contextmanager
def stage(name: str, patience_s: float = 0.0) -> Iterator[None]:
    """Mark a stage for the watchdog without timing it (see `StageTimer.stage` for timed ones). `patience_s`: a
    stage known to be long and announced to the user (a one-time build) raises no line before it has passed."""
    enter(name)
    _PROGRESS.patience = patience_s
    try:
        yield
    finally:
        _PROGRESS.patience = 0.0
        leave()


def current_stack() -> tuple[str, ...]:
    """The stages this rank is in, outermost first."""
    return _PROGRESS.stack


def _mark() -> None:
    _PROGRESS.since_wall = time.time()
    _PROGRESS.count += 1
    for listener in _LISTENERS:
        listener()


_LISTENERS: list[Callable[[], None]] = []


def on_change(listener: Callable[[], None]) -> None:
    """Call `listener()` after every stage entered or left, on the thread that entered or left it."""
    _LISTENERS.append(listener)


def off_change(listener: Callable[[], None]) -> None:
    _LISTENERS.remove(listener)


def describe() -> str:
    """`in stage 'step/experience' since 12:03:11 (step 7)` for the current record; outside any stage,
    `outside any stage since ... (after 'step')`, or `in setup since ...` before the first one."""
    p = _PROGRESS
    since = time.strftime("%H:%M:%S", time.localtime(p.since_wall))
    step = f" (step {p.step})" if p.step is not None else ""
    if p.stack:
        return f"in stage '{'/'.join(p.stack)}' since {since}{step}"
    if p.last_left is None:
        return f"in setup (before the first stage) since {since}"
    return f"outside any stage since {since}, after '{p.last_left}'{step}"


class Watchdog:
    """Prints `[rank R] no progress for N s: in stage ...` every `interval_s` seconds without progress.

    `check()` does one test and is what the thread runs each tick; tests call it with a fake `clock`.
    `interval_s` <= 0 disables it (`start` does nothing).
    """

    def __init__(self, rank: int, interval_s: float, clock: Callable[[], float] = time.monotonic,
                 out: TextIO | None = None) -> None:
        self.rank, self.interval_s, self.clock, self.out = rank, interval_s, clock, out
        self._seen, self._seen_at = _PROGRESS.count, clock()  # last progress observed, and when
        self._reports = 0  # lines printed since then
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> str | None:
        """The line printed now, if one is due (else None)."""
        now = self.clock()
        if _PROGRESS.count != self._seen:
            self._seen, self._seen_at, self._reports = _PROGRESS.count, now, 0
        idle = now - self._seen_at
        if idle < max(self.interval_s, _PROGRESS.patience) * (self._reports + 1):
            return None
        self._reports += 1
        line = f"[rank {self.rank}] no progress for {idle:.0f} s: {describe()}"
        print(line, file=self.out or sys.stderr, flush=True)
        return line

    def start(self) -> Watchdog:
        if self.interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rlhf-watchdog", daemon=True)
            self._thread.start()
            atexit.register(self._join)
        return self

    def stop(self) -> None:
        self._stop.set()

    def _join(self) -> None:
        """At interpreter exit: no thread of ours is left running while Python finalizes (see heartbeat.py)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        tick = min(1.0, self.interval_s / 4)
        while not self._stop.wait(tick):
            self.check()

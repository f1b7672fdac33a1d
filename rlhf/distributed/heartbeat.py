"""Ends a run whose peer stopped: each rank's daemon thread writes a heartbeat (a counter and the stage it is in)
to the rendezvous store every `period_s`, and soon after each stage change, and reads the next rank's (rank r
watches r + 1 mod the world: every rank is watched, and the store sees two operations per rank and tick). A peer
whose counter has not moved for `--dist_timeout` less two periods (so this fires before a collective's own timeout,
which names nobody) is stopped (SIGSTOP, a frozen host, a rank hung holding the GIL): the thread prints one line
naming the silent rank, the stage it was in at its last heartbeat and the stage this rank waits in, then ends this
process with exit status 1, upon which the launcher (torchrun, `srun --kill-on-bad-exit`) stops the rest. A
collective in DeepSpeed's or NCCL's hands may wait past the group's timeout; this does not. A store that stops
answering for `timeout_s` (its host is gone) ends the rank the same way. Ranks that finished (`stop()`) are not
waited for. Counters, not clocks: hosts' clocks may disagree. The first rank to end the run says why in the store,
and every other rank ends at its next tick with that line: a rank waiting in a collective with the ended one (gloo
may wait out the whole --dist_timeout for a peer that exited) or one that was itself stopped and is now continued.
A rank that was paused (stopped and continued, a frozen host) measures its peers' silence afresh instead of blaming
them for its own pause.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

import torch.distributed as dist

from rlhf.utils import watchdog

EXIT_STATUS = 1
JOIN_TIMEOUT_S = 30.0  # a store call in flight at exit ends within the store's own timeout, or this
DONE = "done"
ENDED_KEY = "heartbeat/ended"  # "RANK|WHY" of the first rank that ended the run: every other rank ends at its next tick
MIN_BEAT_S = 1.0
"""The shortest time between two heartbeats (one store write and one read per rank: a beat on every stage change
of a fast step would load the store of a large world)."""
LATE_TICK_S = 2.0
"""A tick this much later than the longest regular gap (`period_s` + MIN_BEAT_S) means this rank itself was not
running (stopped and continued, a host that froze, a thread starved of the GIL): what it saw of its peers before
is stale, and their silence is measured afresh from this tick, instead of blaming a peer for this rank's pause."""


class Heartbeat:
    """One rank's heartbeat and its watch over the peers. `check()` is one tick (tests call it with a fake
    `clock`); `start()` runs it every `period_s` on a daemon thread; `exit` ends the process."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float, *,
                 period_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 out: TextIO | None = None, exit: Callable[[int], None] = os._exit) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.period_s = period_s if period_s is not None else min(10.0, timeout_s / 4)
        # silent for this long: ended before a collective's own --dist_timeout fires and names nobody
        self.timeout_s = max(timeout_s - 2 * self.period_s, timeout_s / 2)
        self.clock, self.out, self.exit = clock, out, exit
        self._count = 0
        start = clock()
        watched = [(rank + 1) % world_size] if world_size > 1 else []
        self._seen: dict[int, tuple[str | None, float]] = {r: (None, start) for r in watched}
        self._store_ok_at = start
        self._ticked_at = start
        self._stop = threading.Event()
        self._changed = threading.Event()  # set by the watchdog when this rank enters or leaves a stage

    def _key(self, rank: int) -> str:
        return f"heartbeat/{rank}"

    def beat(self, value: str | None = None) -> None:
        self._count += 1
        self.store.set(self._key(self.rank), value or f"{self._count}|{watchdog.describe()}")

    def check(self) -> list[int]:
        """Write this rank's heartbeat, read the peers'; returns the silent ranks (and ends the process when
        there are any)."""
        now = self.clock()
        paused = now - self._ticked_at if now - self._ticked_at > self.period_s + MIN_BEAT_S + LATE_TICK_S else 0.0
        if paused:  # this rank was not running: its peers' silence is measured afresh
            self._seen = {peer: (last, now) for peer, (last, _) in self._seen.items()}
            self._store_ok_at = now
        self._ticked_at = now
        try:
            self.beat()
            values = [self.store.get(k) if self.store.check([k]) else b"" for k in map(self._key, self._seen)]
            ended = self.store.get(ENDED_KEY).decode() if self.store.check([ENDED_KEY]) else None
            self._store_ok_at = now
        except (RuntimeError, dist.DistStoreError) as err:
            if now - self._store_ok_at > self.timeout_s:
                self._end(f"the rendezvous store has not answered for {now - self._store_ok_at:.0f} s ({err}): "
                          "its host (torchrun's agent, or rank 0 under srun) is gone", tell_peers=False)
            return []
        if ended is not None:  # another rank ended the run: this one may be waiting in a collective that never ends
            rank, why = ended.split("|", 1)
            pause = f"; this rank was not running for {paused:.0f} s before (stopped, or its host froze)"
            self._end(f"rank {rank} ended the run ({why})" + (pause if paused else ""))
            return []
        silent = []
        for (peer, (last, since)), raw in zip(list(self._seen.items()), values):
            value = raw.decode() if raw else None
            if value != last:
                self._seen[peer] = (value, now)
            elif value != DONE and now - since > self.timeout_s:
                silent.append(peer)
        if silent:
            described = "; ".join(f"rank {r} {self._last_stage(r)}" for r in silent)
            self._end(f"no heartbeat for more than {self.timeout_s:g} s from {described}")
        return silent

    def _last_stage(self, rank: int) -> str:
        value = self._seen[rank][0]
        return f"(at its last heartbeat {value.split('|', 1)[1]})" if value else "(never reported)"

    def _end(self, why: str, tell_peers: bool = True) -> None:
        """Ends this rank with one line; the first rank to end says why in the store, for the others."""
        if tell_peers:
            with contextlib.suppress(RuntimeError, dist.DistStoreError):
                if not self.store.check([ENDED_KEY]):
                    self.store.set(ENDED_KEY, f"{self.rank}|{why}")
        print(f"\n[rank {self.rank}] {why}; this rank is {watchdog.describe()}: ending the run (exit "
              f"{EXIT_STATUS}); the last complete checkpoint is intact", file=self.out or sys.stderr, flush=True)
        self.exit(EXIT_STATUS)

    def start(self) -> Heartbeat:
        self.beat()  # at once: a peer that starts its watch first finds this rank's key
        watchdog.on_change(self._changed.set)
        self._thread = threading.Thread(target=self._run, name="rlhf-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.join)
        return self

    def join(self) -> None:
        """At the end of the run, and at interpreter exit: end the thread before Python finalizes. A daemon thread
        still inside a store call then (C++ that released the GIL) is ended by the interpreter as it takes the GIL
        back, and that unwinds through C++ frames that may not be unwound: `terminate called without an active
        exception`, exit -6, after a run that succeeded."""
        self._stop.set()
        self._changed.set()
        self._thread.join(timeout=JOIN_TIMEOUT_S)
        with contextlib.suppress(ValueError):  # joined twice: at the end of the run and at exit
            watchdog.off_change(self._changed.set)

    def stop(self) -> None:
        """This rank is done: peers stop waiting for its heartbeat."""
        self._stop.set()
        try:
            self.beat(DONE)
        except (RuntimeError, dist.DistStoreError):
            pass

    def _run(self) -> None:
        """A tick every `period_s`, and soon after this rank enters or leaves a stage (at most one a
        MIN_BEAT_S): a peer that names this rank's stage names the one it was in, not one a period old. The waits
        end at a deadline on the monotonic clock, which runs on while the process is stopped: a rank continued after
        a pause longer than the wait ticks at once."""
        while not self._stop.wait(MIN_BEAT_S):
            self._changed.wait(self.period_s)
            self._changed.clear()
            if not self._stop.is_set():
                self.check()

"""Wall-clock timing of named stages."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rlhf.utils import watchdog


class StageTimer:
    """Accumulates seconds per stage name; `pop()` returns and clears them. Entering and leaving a stage
    is also this rank's progress record for `rlhf.utils.watchdog`."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        watchdog.enter(name)
        try:
            yield
        finally:
            watchdog.leave()
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out, self._seconds = {f"time/{k}": v for k, v in self._seconds.items()}, {}
        return out

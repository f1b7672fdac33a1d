"""Graceful preemption: SIGTERM / SIGUSR1 (SLURM's warning signals) ask the job to stop at the end of
the current step, after writing a checkpoint. Ranks may receive the signal at different times, so
the decision to stop is agreed with an all-reduce at a step boundary."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class PreemptionWatch:
    """Installs the handlers on construction; `should_stop()` is collective over the world."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.requested = False
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def should_stop(self) -> bool:
        """True on every rank if any rank was signalled. Every rank calls it once per step."""
        flag = torch.tensor([1.0 if self.requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

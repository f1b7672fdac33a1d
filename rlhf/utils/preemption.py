"""Graceful preemption: SIGTERM / SIGUSR1 (SLURM's warning signals) ask the job to stop at the end of
the current step, after writing a checkpoint. Ranks may receive the signal at different times, so
the decision to stop is agreed with an all-reduce at a step boundary.

Under torchrun a worker also stops this way when its launcher is gone: plain torchrun dies at once on a
signal it does not handle (SIGUSR1, the usual `#SBATCH --signal` choice), and its workers, left running
with nobody to stop them, would train on unsupervised until the next collective timeout. They notice the
new parent process, checkpoint at the end of the step and exit 0. Only under torchrun: a job started
from a shell that then exits (`nohup`) is meant to keep running."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

PARENT_POLL_S = 1.0


class PreemptionWatch:
    """Installs the handlers on construction (and, under torchrun, a daemon thread watching the launcher);
    `should_stop()` is collective over the world."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, watch_parent: bool | None = None) -> None:
        self.requested = False
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)
        if watch_parent if watch_parent is not None else "TORCHELASTIC_RUN_ID" in os.environ:
            self._parent = os.getppid()
            threading.Thread(target=self._watch_parent, name="rlhf-launcher-watch", daemon=True).start()

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def _watch_parent(self) -> None:
        while os.getppid() == self._parent:
            time.sleep(PARENT_POLL_S)
        print(f"[rank {os.environ.get('RANK', '0')}] the launcher (pid {self._parent}) is gone: checkpointing at "
              "the end of this step, then exiting", file=sys.stderr, flush=True)
        self.requested = True

    def should_stop(self) -> bool:
        """True on every rank if any rank was signalled. Every rank calls it once per step."""
        flag = torch.tensor([1.0 if self.requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

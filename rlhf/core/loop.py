"""The training loop of every job: steps, logging every --logging_steps, evaluation, a checkpoint every
--save_steps, and preemption (SIGTERM/SIGUSR1: checkpoint at the next step boundary, then stop). The job
supplies one step, its evaluation and its checkpointed state; the loop knows nothing else about it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rlhf.core.checkpointer import Checkpointer
from rlhf.core.state import CheckpointedState
from rlhf.core.throughput import Throughput
from rlhf.engines.deepspeed_engine import NonFiniteError
from rlhf.utils import watchdog
from rlhf.utils.logging import MetricsLogger
from rlhf.utils.preemption import PreemptionWatch
from rlhf.utils.timers import StageTimer


class Job(Protocol):
    """One job's step, on every rank."""

    timer: StageTimer  # the job's stages are timed with it; the loop adds "step" and reports them all

    def step(self, step: int) -> dict[str, float]:
        """Run training step `step` (0-based); return its global metrics (the same on every rank)."""
        ...

    def evaluate(self) -> dict[str, float]:
        """Metrics on the held-out data ({} when the job has none). Collective, like `step`."""
        ...

    def checkpointed(self) -> CheckpointedState:
        """The job's state a checkpoint holds."""
        ...


@dataclass
class Loop:
    """Runs a job's steps. `eval_every`: evaluate before the first step, after every N steps and after the
    last (None: never)."""

    total_steps: int
    logging_steps: int
    save_steps: int
    eval_every: int | None
    logger: MetricsLogger
    checkpointer: Checkpointer
    rank: int
    throughput: Throughput | None = None  # adds perf/* metrics to every step (a collective)

    def fit(self, job: Job, start_step: int = 0, preemption: PreemptionWatch | None = None) -> bool:
        """Run steps until the end (True) or until a preemption signal, after checkpointing (False). A fresh
        run with evaluation also evaluates the initial model (logged as step 0), the baseline of the curve."""
        if self.eval_every and start_step == 0:
            with watchdog.stage("evaluate"):
                self.logger.log(0, job.evaluate())
        for step in range(start_step, self.total_steps):
            done = step + 1
            watchdog.set_step(done)
            with job.timer.stage("step"):
                try:
                    metrics = job.step(step)
                except NonFiniteError as err:  # name the training step too, not only the optimizer step
                    raise NonFiniteError(f"training step {done}, {err}") from None
            metrics.update(job.timer.pop())
            if self.throughput is not None:
                metrics.update(self.throughput.metrics(metrics))
            if self.eval_every and (done % self.eval_every == 0 or done == self.total_steps):
                with watchdog.stage("evaluate"):
                    metrics.update(job.evaluate())
            if done % self.logging_steps == 0:
                self.logger.log(done, metrics)
            self.logger.advance(metrics)
            saved = self.save_steps > 0 and done % self.save_steps == 0
            if saved:
                self.save(job, done)
            if preemption is not None and preemption.should_stop():
                if not saved:
                    self.save(job, done)
                if self.rank == 0:
                    print(f"preempted: checkpoint after step {done} written, exiting", flush=True)
                return False
        return True

    def save(self, job: Job, done_steps: int) -> str:
        with watchdog.stage("checkpoint"):
            return self.checkpointer.save(job.checkpointed(), done_steps)

    def resume(self, job: Job) -> int:
        """Steps already done (0 for a fresh run); see `Checkpointer.resume`."""
        start = self.checkpointer.resume(job.checkpointed())
        self.logger.skip(start)
        return start

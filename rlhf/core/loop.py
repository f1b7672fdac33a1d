"""The training loop of every job: steps, logging every --logging_steps, evaluation, a checkpoint every
--save_steps, and preemption (SIGTERM/SIGUSR1: checkpoint at the next step boundary, then stop; a step the job
abandoned on SIGTERM and rolled back: checkpoint the last completed step, see `rlhf.utils.preemption`). The job
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
from rlhf.utils.preemption import PreemptionWatch, StepAbandoned
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
        run with evaluation also evaluates the initial model (logged as step 0), the baseline of the curve.
        A checkpoint still being written in the background (--async_save) is completed before it returns."""
        if self.eval_every and start_step == 0:
            with watchdog.stage("evaluate"):
                self.logger.log(0, job.evaluate())
        saved_at = start_step  # the newest checkpoint's step (the resumed one, if any)
        for step in range(start_step, self.total_steps):
            done = step + 1
            watchdog.set_step(done)
            try:
                with job.timer.stage("step"):
                    try:
                        metrics = job.step(step)
                    except NonFiniteError as err:  # name the training step too, not only the optimizer step
                        raise NonFiniteError(f"training step {done}, {err}") from None
            except StepAbandoned:  # the job has rolled the step back
                job.timer.pop()
                self._abandoned(job, step, saved_at, preemption.cause() if preemption else "preempted")
                return False
            metrics.update(job.timer.pop())
            if self.throughput is not None:
                metrics.update(self.throughput.metrics(metrics))
            if self.eval_every and (done % self.eval_every == 0 or done == self.total_steps):
                with watchdog.stage("evaluate"):
                    metrics.update(job.evaluate())
            if done % self.logging_steps == 0:
                self.logger.log(done, metrics)
            self.logger.advance(metrics)
            if self.save_steps > 0 and done % self.save_steps == 0:
                self.save(job, done)
                saved_at = done
            else:
                self.checkpointer.settle(wait=False)  # completes one written in the background, once it is
            if preemption is not None and preemption.should_stop():
                if saved_at != done:
                    self.save(job, done)
                self.finish_saving()
                if self.rank == 0:
                    print(f"{preemption.cause()}: checkpoint after step {done} written, exiting", flush=True)
                return False
        self.finish_saving()
        return True

    def _abandoned(self, job: Job, step: int, saved_at: int, cause: str) -> None:
        """Step `step` was abandoned (SIGTERM, Ctrl-C) and rolled back: checkpoint the steps done, unless the newest
        checkpoint already holds them."""
        if step > saved_at:
            self.save(job, step)
        self.finish_saving()
        if self.rank == 0:
            kept = (f"checkpoint after step {step} written" if step > saved_at else
                    f"the checkpoint after step {step} holds every step done" if step else "no step was done")
            print(f"{cause} during step {step + 1}: its work dropped; {kept}, exiting", flush=True)

    def save(self, job: Job, done_steps: int) -> str | None:
        with watchdog.stage("checkpoint"):
            return self.checkpointer.save(job.checkpointed(), done_steps)

    def finish_saving(self) -> None:
        """Complete the checkpoint still being written in the background (--async_save), if any."""
        with watchdog.stage("checkpoint"):
            self.checkpointer.finish()

    def resume(self, job: Job) -> int:
        """Steps already done (0 for a fresh run); see `Checkpointer.resume`."""
        start = self.checkpointer.resume(job.checkpointed())
        self.logger.skip(start)
        return start


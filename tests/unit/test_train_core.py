"""The job-agnostic core: the loop's cadence (logging, evaluation before/every N/after the last step, checkpoints),
preemption (a step abandoned on SIGTERM: the last completed step checkpointed, once), the rollback point of the
HF engine's decode, and a non-finite step named."""

from __future__ import annotations

import json

import pytest

from rlhf.core.loop import Loop
from rlhf.core.state import CheckpointedState
from rlhf.engines.deepspeed_engine import NonFiniteError
from rlhf.utils.logging import MetricsLogger
from rlhf.utils.preemption import StepAbandoned
from rlhf.utils.timers import StageTimer


class FakeJob:
    def __init__(self, fail_at: int | None = None, abandon_at: int | None = None) -> None:
        self.timer, self.fail_at, self.abandon_at = StageTimer(), fail_at, abandon_at
        self.evaluated, self.steps = [], []

    def step(self, step: int) -> dict[str, float]:
        if step == self.fail_at:
            raise NonFiniteError("optimizer step 9: model policy_loss is nan on rank 1; stopping")
        if step == self.abandon_at:
            raise StepAbandoned
        self.steps.append(step)
        return {"loss": float(step)}

    def evaluate(self) -> dict[str, float]:
        self.evaluated.append(len(self.steps))
        return {"eval_loss": -float(len(self.steps))}

    def checkpointed(self) -> CheckpointedState:
        return CheckpointedState()


class FakeCheckpointer:
    def __init__(self) -> None:
        self.saved = []

    def save(self, state: CheckpointedState, done_steps: int) -> str:
        self.saved.append(done_steps)
        return f"global_step{done_steps}"

    def settle(self, wait: bool) -> None:
        pass

    def finish(self) -> None:
        pass


class StopAfter:
    def __init__(self, calls: int, cause: str = "preempted (SIGTERM)") -> None:
        self.calls, self._cause = calls, cause

    def should_stop(self) -> bool:
        self.calls -= 1
        return self.calls == 0

    def cause(self) -> str:
        return self._cause


def _loop(tmp_path, total=7, logging_steps=2, save_steps=3, eval_every=3):
    logger = MetricsLogger(str(tmp_path), None, total, enabled=True, bar_metrics={})
    return Loop(total, logging_steps, save_steps, eval_every, logger, FakeCheckpointer(), rank=0)


def _rows(tmp_path):
    with open(tmp_path / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_loop_logs_evaluates_and_checkpoints_on_its_cadence(tmp_path):
    loop, job = _loop(tmp_path), FakeJob()
    assert loop.fit(job) is True
    assert job.steps == list(range(7))
    assert job.evaluated == [0, 3, 6, 7]  # before training, every 3 steps, after the last
    assert loop.checkpointer.saved == [3, 6]
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 2, 4, 6]
    assert rows[0] == {"step": 0, "eval_loss": 0.0}
    assert rows[2]["loss"] == 3.0 and "time/step" in rows[2] and "eval_loss" not in rows[2]
    assert rows[3]["eval_loss"] == -6.0


def test_preemption_checkpoints_once_and_stops(tmp_path):
    loop, job = _loop(tmp_path, eval_every=None), FakeJob()
    assert loop.fit(job, start_step=1, preemption=StopAfter(4)) is False
    assert job.steps == [1, 2, 3, 4] and loop.checkpointer.saved == [3, 5]
    assert job.evaluated == []


@pytest.mark.parametrize(("start", "abandon_at", "saved", "said"), [
    (0, 4, [3, 4], "checkpoint after step 4 written"),  # steps 1-4 done, step 3's checkpoint is older
    (1, 3, [3], "the checkpoint after step 3 holds every step done"),  # step 3's checkpoint is the newest
    (2, 2, [], "the checkpoint after step 2 holds every step done"),  # resumed at 2, nothing done since
    (0, 0, [], "no step was done"),
])
def test_an_abandoned_step_checkpoints_the_last_completed_step_once(tmp_path, capsys, start, abandon_at, saved,
                                                                     said):
    loop, job = _loop(tmp_path, eval_every=None), FakeJob(abandon_at=abandon_at)
    assert loop.fit(job, start_step=start, preemption=StopAfter(0)) is False
    assert job.steps == list(range(start, abandon_at)) and loop.checkpointer.saved == saved
    assert capsys.readouterr().out.strip().endswith(
        f"preempted (SIGTERM) during step {abandon_at + 1}: its work dropped; {said}, exiting")


def test_a_nonfinite_step_names_the_training_step(tmp_path):
    loop = _loop(tmp_path, eval_every=None)
    with pytest.raises(NonFiniteError, match=r"^training step 5, optimizer step 9: model policy_loss is nan"):
        loop.fit(FakeJob(fail_at=4))


def _supervised_trainers() -> list[type]:
    """Every trainer class of the product with a metric table of its own (the concrete ones)."""
    import rlhf.trainers.kd_trainer
    import rlhf.trainers.preference_trainers
    import rlhf.trainers.prm_trainer
    import rlhf.trainers.rm_trainer
    import rlhf.trainers.sft_trainer  # noqa: F401
    from rlhf.trainers.supervised_trainer import SupervisedTrainer

    found, todo = [], [SupervisedTrainer]
    while todo:
        subs = todo.pop().__subclasses__()
        todo += subs
        found += [c for c in subs if c.__module__.startswith("rlhf.") and "metrics" in vars(c)]
    return found


def test_an_evaluation_whose_sums_differ_from_its_declaration_fails_and_every_trainer_declares(monkeypatch):
    """A frozen role on ranks of its own mirrors the collectives of the trainer it serves from the trainer's
    `eval_sums`: a declaration that differs from the sums `evaluate` adds over the world fails the evaluation
    (colocated too, so the first test of a new trainer catches it) instead of hanging a split run."""
    import torch.distributed as dist

    from rlhf.trainers.supervised_trainer import SupervisedTrainer

    class Topology:
        def replica_rank(self, role):
            return 0

    class Model:
        def eval(self):
            pass

    class Scores(SupervisedTrainer):
        metrics = {}
        eval_sums = (3,)

        def eval_batches(self):
            return [1.0, 2.0], 2

        def eval_scores(self, items):
            for x in items:
                yield x, 2 * x, 1.0

        def eval_metrics(self, totals):
            return {"eval_mean": totals[1] / totals[0]}

    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: None)
    trainer = object.__new__(Scores)
    trainer.eval_samples, trainer.model, trainer.topology = [0], Model(), Topology()
    assert trainer.evaluate() == {"eval_mean": 6.0 / 3.0}
    trainer.eval_sums = (2,)
    with pytest.raises(RuntimeError, match=r"sums of lengths \(3,\) .* declares eval_sums = \(2,\)"):
        trainer.evaluate()

    trainers = {t.__name__: t.eval_sums for t in _supervised_trainers()}
    assert trainers == {"SFTTrainer": (2,), "RewardModelTrainer": (5,), "ProcessRewardTrainer": (3,),
                        "DistillationTrainer": (3,), "DPOTrainer": (6,), "SimPOTrainer": (6,),
                        "ORPOTrainer": (6,), "CPOTrainer": (6,), "KTOTrainer": (2, 8)}

"""The ORPO job's parts (`ORPO_JOB`) and its run; the entry point is `rlhf.cli.train_orpo`."""

from __future__ import annotations

from rlhf.config.preference_config import TrainORPOConfig
from rlhf.jobs.dpo import pair_samples
from rlhf.jobs.sft import SFT_JOB
from rlhf.jobs.supervised_run import SupervisedJob, run_supervised, save_trained_model
from rlhf.trainers.preference_trainers import ORPOTrainer

ORPO_JOB = SupervisedJob(
    name="orpo", samples=pair_samples, load_model=SFT_JOB.load_model, save=save_trained_model,
    make_trainer=lambda cfg, b: ORPOTrainer(*b.trainer_args, orpo_lambda=cfg.orpo_lambda),
    bar={"loss": "loss", "nll": "nll_loss", "acc": "acc"},
    demo_line="no --pretrain given: ORPO of the embedded tiny demo model on its pairs")


def run(cfg: TrainORPOConfig, parse_warnings=()) -> None:
    run_supervised(ORPO_JOB, cfg, parse_warnings)

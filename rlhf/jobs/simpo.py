"""The SIMPO job's parts (`SIMPO_JOB`) and its run; the entry point is `rlhf.cli.train_simpo`."""

from __future__ import annotations

from rlhf.config.preference_config import TrainSimPOConfig
from rlhf.jobs.dpo import pair_samples
from rlhf.jobs.sft import SFT_JOB
from rlhf.jobs.supervised_run import SupervisedJob, run_supervised, save_trained_model
from rlhf.trainers.preference_trainers import SimPOTrainer

SIMPO_JOB = SupervisedJob(
    name="simpo", samples=pair_samples, load_model=SFT_JOB.load_model, save=save_trained_model,
    make_trainer=lambda cfg, b: SimPOTrainer(*b.trainer_args, beta=cfg.beta, gamma=cfg.simpo_gamma),
    bar={"loss": "loss", "acc": "acc", "margin": "margin"},
    demo_line="no --pretrain given: SimPO of the embedded tiny demo model on its pairs")


def run(cfg: TrainSimPOConfig, parse_warnings=()) -> None:
    run_supervised(SIMPO_JOB, cfg, parse_warnings)

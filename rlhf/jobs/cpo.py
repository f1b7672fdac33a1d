"""The CPO job's parts (`CPO_JOB`) and its run; the entry point is `rlhf.cli.train_cpo`."""

from __future__ import annotations

from rlhf.config.preference_config import TrainCPOConfig
from rlhf.jobs.dpo import pair_samples
from rlhf.jobs.sft import SFT_JOB
from rlhf.jobs.supervised_run import SupervisedJob, run_supervised, save_trained_model
from rlhf.trainers.preference_trainers import CPOTrainer

CPO_JOB = SupervisedJob(
    name="cpo", samples=pair_samples, load_model=SFT_JOB.load_model, save=save_trained_model,
    make_trainer=lambda cfg, b: CPOTrainer(*b.trainer_args, beta=cfg.beta, cpo_alpha=cfg.cpo_alpha),
    bar={"loss": "loss", "acc": "acc", "margin": "margin"},
    demo_line="no --pretrain given: CPO of the embedded tiny demo model on its pairs")


def run(cfg: TrainCPOConfig, parse_warnings=()) -> None:
    run_supervised(CPO_JOB, cfg, parse_warnings)

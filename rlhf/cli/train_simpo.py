"""Entry point of SimPO (Meng et al. 2024), a reference-free preference loss:
`torchrun ... -m rlhf.cli.train_simpo --pretrain ... --dataset ...` (or srun), with train_dpo's data, batch and
engine flags, --beta and --simpo_gamma. The loss is -log sigmoid(beta (chosen - rejected average log-prob) -
gamma): no reference model is loaded. Without --pretrain: the embedded tiny model learns to prefer the
embedded pairs' chosen answers. The policy is written in HF format to --save_path.
"""

from __future__ import annotations

from rlhf.cli.entry_point import main_for
from rlhf.cli.supervised_run import SupervisedJob, run_supervised, save_trained_model
from rlhf.cli.train_dpo import pair_samples
from rlhf.cli.train_sft import SFT_JOB
from rlhf.config.preference_config import TrainSimPOConfig
from rlhf.trainers.preference_trainers import SimPOTrainer

SIMPO_JOB = SupervisedJob(
    name="simpo", samples=pair_samples, load_model=SFT_JOB.load_model, save=save_trained_model,
    make_trainer=lambda cfg, b: SimPOTrainer(*b.trainer_args, beta=cfg.beta, gamma=cfg.simpo_gamma),
    bar={"loss": "loss", "acc": "acc", "margin": "margin"},
    demo_line="no --pretrain given: SimPO of the embedded tiny demo model on its pairs")


def main(argv: list[str] | None = None) -> None:
    main_for(TrainSimPOConfig, lambda cfg, w: run_supervised(SIMPO_JOB, cfg, w), "python -m rlhf.cli.train_simpo",
             argv)


if __name__ == "__main__":
    main()

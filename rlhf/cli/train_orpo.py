"""Entry point of ORPO (Hong et al. 2024), a reference-free preference loss:
`torchrun ... -m rlhf.cli.train_orpo --pretrain ... --dataset ...` (or srun), with train_dpo's data, batch and
engine flags and --orpo_lambda. The loss is the chosen responses' per-token NLL + lambda x -log sigmoid(log
odds ratio of the chosen over the rejected response): supervised fine-tuning and preference alignment in one
stage, no reference model. Without --pretrain: the embedded tiny model on the embedded pairs. The policy is
written in HF format to --save_path.
"""

from __future__ import annotations

from rlhf.cli.entry_point import main_for
from rlhf.cli.supervised_run import SupervisedJob, run_supervised, save_trained_model
from rlhf.cli.train_dpo import pair_samples
from rlhf.cli.train_sft import SFT_JOB
from rlhf.config.preference_config import TrainORPOConfig
from rlhf.trainers.preference_trainers import ORPOTrainer

ORPO_JOB = SupervisedJob(
    name="orpo", samples=pair_samples, load_model=SFT_JOB.load_model, save=save_trained_model,
    make_trainer=lambda cfg, b: ORPOTrainer(*b.trainer_args, orpo_lambda=cfg.orpo_lambda),
    bar={"loss": "loss", "nll": "nll_loss", "acc": "acc"},
    demo_line="no --pretrain given: ORPO of the embedded tiny demo model on its pairs")


def main(argv: list[str] | None = None) -> None:
    main_for(TrainORPOConfig, lambda cfg, w: run_supervised(ORPO_JOB, cfg, w), "python -m rlhf.cli.train_orpo", argv)


if __name__ == "__main__":
    main()

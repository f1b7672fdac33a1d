"""Entry point of ORPO (Hong et al. 2024), a reference-free preference loss:
`torchrun ... -m rlhf.cli.train_orpo --pretrain ... --dataset ...` (or srun), with train_dpo's data, batch and
engine flags and --orpo_lambda. The loss is the chosen responses' per-token NLL + lambda x -log sigmoid(log
odds ratio of the chosen over the rejected response): supervised fine-tuning and preference alignment in one
stage, no reference model. Without --pretrain: the embedded tiny model on the embedded pairs. The policy is
written in HF format to --save_path.
"""

from __future__ import annotations

from rlhf.cli.entry_point import deferred, main_for
from rlhf.config.preference_config import TrainORPOConfig

JOB_MODULE = "rlhf.jobs.orpo"  # the run, imported once the flags have parsed (and by rlhf.cli.warm_start)


def main(argv: list[str] | None = None) -> None:
    main_for(TrainORPOConfig, deferred(JOB_MODULE), "python -m rlhf.cli.train_orpo", argv)


if __name__ == "__main__":
    main()

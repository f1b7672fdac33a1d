"""Entry point of SimPO (Meng et al. 2024), a reference-free preference loss:
`torchrun ... -m rlhf.cli.train_simpo --pretrain ... --dataset ...` (or srun), with train_dpo's data, batch and
engine flags, --beta and --simpo_gamma. The loss is -log sigmoid(beta (chosen - rejected average log-prob) -
gamma): no reference model is loaded. Without --pretrain: the embedded tiny model learns to prefer the
embedded pairs' chosen answers. The policy is written in HF format to --save_path.
"""

from __future__ import annotations

from rlhf.cli.entry_point import deferred, main_for
from rlhf.config.preference_config import TrainSimPOConfig

JOB_MODULE = "rlhf.jobs.simpo"  # the run, imported once the flags have parsed (and by rlhf.cli.warm_start)


def main(argv: list[str] | None = None) -> None:
    main_for(TrainSimPOConfig, deferred(JOB_MODULE), "python -m rlhf.cli.train_simpo", argv)


if __name__ == "__main__":
    main()

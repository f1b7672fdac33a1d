"""Entry point of supervised fine-tuning: `torchrun ... -m rlhf.cli.train_sft --pretrain ... --dataset ...`
(or srun), with OpenRLHF v0.9.5's train_sft flags. Without --pretrain: the embedded tiny model learns the
embedded copy-task demonstrations. The model is written in HF format to --save_path.
"""

from __future__ import annotations

from rlhf.cli.entry_point import deferred, main_for
from rlhf.config.supervised_config import TrainSFTConfig

JOB_MODULE = "rlhf.jobs.sft"  # the run, imported once the flags have parsed (and by rlhf.cli.warm_start)


def main(argv: list[str] | None = None) -> None:
    main_for(TrainSFTConfig, deferred(JOB_MODULE), "python -m rlhf.cli.train_sft", argv)


if __name__ == "__main__":
    main()

"""Entry point of reward-model training: `torchrun ... -m rlhf.cli.train_rm --pretrain ... --dataset ...`
(or srun), with OpenRLHF v0.9.5's train_rm flags. Without --pretrain: the embedded tiny model learns to
prefer the embedded copy-task pairs' chosen answers. The model is written to --save_path as a
sequence-classification checkpoint (loads in `AutoModelForSequenceClassification`, `train_ppo
--reward_pretrain` and `serve_rm`), with the held-out reward mean/std in its config.
"""

from __future__ import annotations

from rlhf.cli.entry_point import deferred, main_for
from rlhf.config.supervised_config import TrainRMConfig

JOB_MODULE = "rlhf.jobs.rm"  # the run, imported once the flags have parsed (and by rlhf.cli.warm_start)


def main(argv: list[str] | None = None) -> None:
    main_for(TrainRMConfig, deferred(JOB_MODULE), "python -m rlhf.cli.train_rm", argv)


if __name__ == "__main__":
    main()

"""Entry point of knowledge distillation: `torchrun ... -m rlhf.cli.train_kd --pretrain STUDENT --teacher_model
TEACHER --dataset ...` (or srun), with OpenRLHF v0.9.5's train_kd flags. The teacher is a frozen role on the
student's ranks (sharded at ZeRO-3, in host memory between forwards with --teacher_offload). Without
--pretrain: the embedded tiny model is the student on the embedded demonstrations (the teacher is always
named). The student is written in HF format to --save_path.
"""

from __future__ import annotations

from rlhf.cli.entry_point import deferred, main_for
from rlhf.config.supervised_config import TrainKDConfig

JOB_MODULE = "rlhf.jobs.kd"  # the run, imported once the flags have parsed (and by rlhf.cli.warm_start)


def main(argv: list[str] | None = None) -> None:
    main_for(TrainKDConfig, deferred(JOB_MODULE), "python -m rlhf.cli.train_kd", argv)


if __name__ == "__main__":
    main()

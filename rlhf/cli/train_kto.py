"""Entry point of KTO: `torchrun ... -m rlhf.cli.train_kto --pretrain ... --dataset ...` (or srun), with OpenRLHF
v0.9.5's train_kto flags: responses labelled desirable or undesirable (--input_key --output_key --label_key;
rows with --chosen_key/--rejected_key instead are pairs, split into one of each), --beta and the two loss
weights. The reference policy is placed as in train_dpo. Without --pretrain: the embedded tiny model on the
embedded pairs, split. The policy is written in HF format to --save_path.
"""

from __future__ import annotations

from rlhf.cli.entry_point import deferred, main_for
from rlhf.config.preference_config import TrainKTOConfig

JOB_MODULE = "rlhf.jobs.kto"  # the run, imported once the flags have parsed (and by rlhf.cli.warm_start)


def main(argv: list[str] | None = None) -> None:
    main_for(TrainKTOConfig, deferred(JOB_MODULE), "python -m rlhf.cli.train_kto", argv)


if __name__ == "__main__":
    main()

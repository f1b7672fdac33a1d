"""Entry point of process-reward-model training: `torchrun ... -m rlhf.cli.train_prm --pretrain ... --dataset
... --placeholder_token TOK --reward_tokens + -` (or srun), with OpenRLHF v0.9.5's train_prm flags. Without
--pretrain: the embedded tiny model learns the embedded step-labelled copy-task answers. The model (a causal
LM whose placeholder logits score steps) is written in HF format to --save_path; `serve_rm --prm` serves it.
"""

from __future__ import annotations

from rlhf.cli.entry_point import deferred, main_for
from rlhf.config.supervised_config import TrainPRMConfig

JOB_MODULE = "rlhf.jobs.prm"  # the run, imported once the flags have parsed (and by rlhf.cli.warm_start)


def main(argv: list[str] | None = None) -> None:
    main_for(TrainPRMConfig, deferred(JOB_MODULE), "python -m rlhf.cli.train_prm", argv)


if __name__ == "__main__":
    main()

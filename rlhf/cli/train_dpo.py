"""Entry point of direct preference optimisation: `torchrun ... -m rlhf.cli.train_dpo --pretrain ... --dataset ...`
(or srun), with OpenRLHF v0.9.5's train_dpo flags: DPO, IPO (--ipo), cDPO (--label_smoothing), an NLL term on
the chosen responses (--nll_loss_coef). The reference policy (--ref_pretrain, default --pretrain) is a frozen
role on the trained model's ranks (in host memory between forwards with --ref_offload) or on ranks of its own
(--ref_num_nodes x --ref_num_gpus_per_node, the last ranks). Without --pretrain: the embedded tiny model learns
to prefer the embedded pairs' chosen answers. The policy is written in HF format to --save_path.
"""

from __future__ import annotations

from rlhf.cli.entry_point import deferred, main_for
from rlhf.config.preference_config import TrainDPOConfig

JOB_MODULE = "rlhf.jobs.dpo"  # the run, imported once the flags have parsed (and by rlhf.cli.warm_start)


def main(argv: list[str] | None = None) -> None:
    main_for(TrainDPOConfig, deferred(JOB_MODULE), "python -m rlhf.cli.train_dpo", argv)


if __name__ == "__main__":
    main()

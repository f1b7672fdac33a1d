"""Entry point of direct preference optimisation: `torchrun ... -m rlhf.cli.train_dpo --pretrain ... --dataset ...`
(or srun), with OpenRLHF v0.9.5's train_dpo flags: DPO, IPO (--ipo), cDPO (--label_smoothing), an NLL term on
the chosen responses (--nll_loss_coef). The reference policy (--ref_pretrain, default --pretrain) is a frozen
role on the trained model's ranks (in host memory between forwards with --ref_offload) or on ranks of its own
(--ref_num_nodes x --ref_num_gpus_per_node, the last ranks). Without --pretrain: the embedded tiny model learns
to prefer the embedded pairs' chosen answers. The policy is written in HF format to --save_path.
"""

from __future__ import annotations

from rlhf.cli.entry_point import main_for
from rlhf.cli.supervised_run import (
    Built,
    SupervisedJob,
    check_frozen_model,
    frozen_plan,
    frozen_role,
    run_supervised,
    save_trained_model,
)
from rlhf.cli.train_sft import SFT_JOB
from rlhf.config.preference_config import PreferenceJobConfig, TrainDPOConfig
from rlhf.core.loop import Job
from rlhf.data.supervised_samples import load_pair_samples
from rlhf.distributed.topology import Role
from rlhf.models.loading import load_causal_lm
from rlhf.trainers.frozen import padded_target_logprobs
from rlhf.trainers.preference_trainers import DPO_METRICS, PAIR_EVAL_SUMS, REFERENCE, DPOTrainer


def check_reference(cfg: PreferenceJobConfig) -> None:
    if cfg.ref.ref_pretrain is not None:
        check_frozen_model(cfg, cfg.ref.ref_pretrain, "--ref_pretrain", "the reference")


def reference_plan(cfg: PreferenceJobConfig, world_size: int) -> dict[Role, tuple[int, ...]]:
    return frozen_plan(REFERENCE, cfg.ref.num_ranks, "--ref_num_nodes x --ref_num_gpus_per_node", world_size)


def with_reference(cfg: PreferenceJobConfig, b: Built, make_trainer, metrics, eval_sums) -> Job:
    """This rank's job: the trained model with its reference colocated or on its own ranks (or, there, the
    reference's service)."""
    m = cfg.model
    load = lambda attn: load_causal_lm(cfg.ref_path, m.dtype, attn, m.trust_remote_code)  # noqa: E731
    return frozen_role(cfg, b, REFERENCE, load, padded_target_logprobs, offload=cfg.ref.ref_offload, tail=(),
                       make_trainer=make_trainer, metrics=metrics, eval_sums=eval_sums)


def pair_samples(cfg, tokenizer, rows: list) -> list:
    """The preference pairs of `rows` (the pair jobs' samples)."""
    d = cfg.data
    samples, _ = load_pair_samples(rows, tokenizer, prompt_key=d.prompt_key, chosen_key=d.chosen_key,
                                   rejected_key=d.rejected_key, input_template=d.input_template,
                                   apply_chat_template=d.apply_chat_template, max_len=d.max_len,
                                   tokenizer_chat_template=d.tokenizer_chat_template, skip_long_prompts=True)
    return samples


def _trainer(cfg: TrainDPOConfig, b: Built) -> Job:
    return with_reference(cfg, b, lambda reference: DPOTrainer(
        *b.trainer_args, reference=reference, beta=cfg.beta, label_smoothing=cfg.label_smoothing, ipo=cfg.ipo,
        nll_loss_coef=cfg.nll_loss_coef), DPO_METRICS, PAIR_EVAL_SUMS)


DPO_JOB = SupervisedJob(
    name="dpo", samples=pair_samples, load_model=SFT_JOB.load_model, make_trainer=_trainer, save=save_trained_model,
    bar={"loss": "loss", "acc": "acc", "margin": "margin"}, check=check_reference, plan=reference_plan,
    demo_line="no --pretrain given: DPO of the embedded tiny demo model on its pairs")


def main(argv: list[str] | None = None) -> None:
    main_for(TrainDPOConfig, lambda cfg, w: run_supervised(DPO_JOB, cfg, w), "python -m rlhf.cli.train_dpo", argv)


if __name__ == "__main__":
    main()

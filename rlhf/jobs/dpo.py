"""The DPO job's parts (`DPO_JOB`) and its run; the entry point is `rlhf.cli.train_dpo`."""

from __future__ import annotations

from rlhf.config.preference_config import PreferenceJobConfig, TrainDPOConfig
from rlhf.core.loop import Job
from rlhf.data.supervised_samples import load_pair_samples
from rlhf.distributed.topology import Role
from rlhf.jobs.sft import SFT_JOB
from rlhf.jobs.supervised_run import (
    Built,
    SupervisedJob,
    check_frozen_model,
    frozen_plan,
    frozen_role,
    run_supervised,
    save_trained_model,
)
from rlhf.models.loading import load_causal_lm
from rlhf.trainers.frozen import padded_target_logprobs
from rlhf.trainers.preference_trainers import REFERENCE, DPOTrainer


def check_reference(cfg: PreferenceJobConfig) -> None:
    if cfg.ref.ref_pretrain is not None:
        check_frozen_model(cfg, cfg.ref.ref_pretrain, "--ref_pretrain", "the reference")


def reference_plan(cfg: PreferenceJobConfig, world_size: int) -> dict[Role, tuple[int, ...]]:
    return frozen_plan(REFERENCE, cfg.ref.num_ranks, "--ref_num_nodes x --ref_num_gpus_per_node", world_size)


def with_reference(cfg: PreferenceJobConfig, b: Built, make_trainer, served: type) -> Job:
    """This rank's job: the trained model with its reference colocated or on its own ranks (or, there, the
    reference's service, which mirrors the collectives `served`, the trainer's class, declares)."""
    m = cfg.model
    load = lambda attn: load_causal_lm(cfg.ref_path, m.dtype, attn, m.trust_remote_code)  # noqa: E731
    return frozen_role(cfg, b, REFERENCE, load, padded_target_logprobs, offload=cfg.ref.ref_offload, tail=(),
                       make_trainer=make_trainer, served=served)


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
        nll_loss_coef=cfg.nll_loss_coef), DPOTrainer)


DPO_JOB = SupervisedJob(
    name="dpo", samples=pair_samples, load_model=SFT_JOB.load_model, make_trainer=_trainer, save=save_trained_model,
    bar={"loss": "loss", "acc": "acc", "margin": "margin"}, check=check_reference, plan=reference_plan,
    demo_line="no --pretrain given: DPO of the embedded tiny demo model on its pairs")


def run(cfg: TrainDPOConfig, parse_warnings=()) -> None:
    run_supervised(DPO_JOB, cfg, parse_warnings)

"""The RM job's parts (`RM_JOB`) and its run; the entry point is `rlhf.cli.train_rm`."""

from __future__ import annotations

from rlhf.config.supervised_config import TrainRMConfig
from rlhf.data.supervised_samples import load_pair_samples
from rlhf.jobs.supervised_run import Built, SupervisedJob, run_supervised, save_trained_model
from rlhf.models.value import load_scalar_head_model
from rlhf.trainers.rm_trainer import RewardModelTrainer


def _samples(cfg: TrainRMConfig, tokenizer, rows: list) -> list:
    d = cfg.data
    samples, _ = load_pair_samples(rows, tokenizer, prompt_key=d.prompt_key, chosen_key=d.chosen_key,
                                   rejected_key=d.rejected_key, margin_key="margin" if d.margin_loss else None,
                                   input_template=d.input_template, apply_chat_template=d.apply_chat_template,
                                   max_len=d.max_len, tokenizer_chat_template=d.tokenizer_chat_template)
    return samples


def _trainer(cfg: TrainRMConfig, b: Built) -> RewardModelTrainer:
    return RewardModelTrainer(*b.trainer_args, loss=cfg.loss, margin_loss=cfg.data.margin_loss)


RM_JOB = SupervisedJob(
    name="rm", samples=_samples,
    load_model=lambda cfg, attn: load_scalar_head_model(cfg.model.pretrain, cfg.model.value_head_prefix,
                                                        cfg.model.dtype, attn, cfg.model.trust_remote_code,
                                                        "--pretrain", fresh_head=True,
                                                        load_in_4bit=cfg.model.lora.load_in_4bit),
    make_trainer=_trainer, save=save_trained_model,
    bar={"loss": "loss", "acc": "acc"},
    demo_line="no --pretrain given: training a reward model from the embedded tiny demo model on its pairs")


def run(cfg: TrainRMConfig, parse_warnings=()) -> None:
    run_supervised(RM_JOB, cfg, parse_warnings)

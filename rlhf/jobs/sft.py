"""The SFT job's parts (`SFT_JOB`) and its run; the entry point is `rlhf.cli.train_sft`."""

from __future__ import annotations

from rlhf.config.supervised_config import TrainSFTConfig
from rlhf.data.supervised_samples import load_sft_samples
from rlhf.jobs.supervised_run import Built, SupervisedJob, run_supervised, save_trained_model
from rlhf.models.loading import load_causal_lm, with_router_aux_loss
from rlhf.trainers.sft_trainer import SFTTrainer


def _samples(cfg: TrainSFTConfig, tokenizer, rows: list) -> list:
    d = cfg.data
    samples, _ = load_sft_samples(rows, tokenizer, input_key=d.input_key, output_key=d.output_key,
                                  input_template=d.input_template, apply_chat_template=d.apply_chat_template,
                                  multiturn=d.multiturn, pretrain_mode=d.pretrain_mode, max_len=d.max_len,
                                  tokenizer_chat_template=d.tokenizer_chat_template)
    return samples


def _trainer(cfg: TrainSFTConfig, b: Built) -> SFTTrainer:
    return SFTTrainer(*b.trainer_args, aux_loss_coef=cfg.aux_loss_coef)


SFT_JOB = SupervisedJob(
    name="sft", samples=_samples,
    load_model=lambda cfg, attn: with_router_aux_loss(
        load_causal_lm(cfg.model.pretrain, cfg.model.dtype, attn, cfg.model.trust_remote_code,
                       cfg.model.lora.load_in_4bit), cfg.aux_loss_coef),
    make_trainer=_trainer, save=save_trained_model, bar={"loss": "gpt_loss"},
    demo_line="no --pretrain given: fine-tuning the embedded tiny demo model on its demonstrations")


def run(cfg: TrainSFTConfig, parse_warnings=()) -> None:
    run_supervised(SFT_JOB, cfg, parse_warnings)

"""The PRM job's parts (`PRM_JOB`) and its run; the entry point is `rlhf.cli.train_prm`."""

from __future__ import annotations

from rlhf.config.supervised_config import TrainPRMConfig
from rlhf.data.supervised_samples import load_prm_samples, token_id
from rlhf.jobs.supervised_run import Built, SupervisedJob, run_supervised, save_trained_model
from rlhf.models.loading import load_causal_lm, with_router_aux_loss
from rlhf.trainers.prm_trainer import ProcessRewardTrainer


def _samples(cfg: TrainPRMConfig, tokenizer, rows: list) -> list:
    d = cfg.data
    samples, _ = load_prm_samples(rows, tokenizer, input_key=d.input_key, label_key=d.label_key,
                                  placeholder_token=d.placeholder_token,
                                  reward_tokens=list(d.reward_tokens) if d.reward_tokens else None, max_len=d.max_len)
    return samples


def _trainer(cfg: TrainPRMConfig, b: Built) -> ProcessRewardTrainer:
    tokens = cfg.data.reward_tokens
    ids = [token_id(b.tokenizer, t, "--reward_tokens") for t in tokens] if tokens else None
    return ProcessRewardTrainer(*b.trainer_args, reward_token_ids=ids, aux_loss_coef=cfg.aux_loss_coef)


PRM_JOB = SupervisedJob(
    name="prm", samples=_samples,
    load_model=lambda cfg, attn: with_router_aux_loss(
        load_causal_lm(cfg.model.pretrain, cfg.model.dtype, attn, cfg.model.trust_remote_code,
                       cfg.model.lora.load_in_4bit), cfg.aux_loss_coef),
    make_trainer=_trainer, save=save_trained_model, bar={"loss": "prm_loss", "acc": "acc"},
    demo_line="no --pretrain given: training a process reward model from the embedded tiny demo model on its "
              "step-labelled answers")


def run(cfg: TrainPRMConfig, parse_warnings=()) -> None:
    run_supervised(PRM_JOB, cfg, parse_warnings)

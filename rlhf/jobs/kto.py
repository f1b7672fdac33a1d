"""The KTO job's parts (`KTO_JOB`) and its run; the entry point is `rlhf.cli.train_kto`."""

from __future__ import annotations

from rlhf.config.preference_config import TrainKTOConfig
from rlhf.core.loop import Job
from rlhf.data.supervised_samples import load_unpaired_samples
from rlhf.jobs.dpo import check_reference, reference_plan, with_reference
from rlhf.jobs.sft import SFT_JOB
from rlhf.jobs.supervised_run import Built, SupervisedJob, run_supervised, save_trained_model
from rlhf.trainers.preference_trainers import KTOTrainer


def _samples(cfg: TrainKTOConfig, tokenizer, rows: list) -> list:
    d = cfg.data
    samples, _ = load_unpaired_samples(rows, tokenizer, input_key=d.input_key, output_key=d.output_key,
                                       label_key=d.label_key, chosen_key=d.chosen_key, rejected_key=d.rejected_key,
                                       input_template=d.input_template, apply_chat_template=d.apply_chat_template,
                                       max_len=d.max_len, tokenizer_chat_template=d.tokenizer_chat_template)
    return samples


def _trainer(cfg: TrainKTOConfig, b: Built) -> Job:
    return with_reference(cfg, b, lambda reference: KTOTrainer(
        *b.trainer_args, reference=reference, beta=cfg.beta, desirable_weight=cfg.desirable_loss_weight,
        undesirable_weight=cfg.undesirable_loss_weight, max_len=cfg.data.max_len), KTOTrainer)


KTO_JOB = SupervisedJob(
    name="kto", samples=_samples, load_model=SFT_JOB.load_model, make_trainer=_trainer, save=save_trained_model,
    bar={"loss": "kto_loss", "kl": "kl"}, check=check_reference, plan=reference_plan,
    demo_line="no --pretrain given: KTO of the embedded tiny demo model on its pairs, split into labelled answers")


def run(cfg: TrainKTOConfig, parse_warnings=()) -> None:
    run_supervised(KTO_JOB, cfg, parse_warnings)
